#!/usr/bin/env bash
# Tear the kind path down: the cluster, the S3 container, and the dockerd that
# e2e/kind/dockerd.sh started (a Docker that was already running stays up).
# Docker's image store ($DSCACHE_DOCKER_ROOT) stays: it is a build cache, like the Go tools.
set -Euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
KIND_CLUSTER=${DSCACHE_KIND_CLUSTER:-dscache-e2e}
STATE_DIR=${DSCACHE_KIND_STATE:-$HOME/.cache/dscache/kind}
export PATH=$STATE_DIR/bin:$PATH
if /usr/bin/docker info >/dev/null 2>&1; then
  KIND=$(bash "$REPO/e2e/tools/tools.sh" --path kind | tail -n1)/kind
  "$KIND" delete cluster --name "$KIND_CLUSTER" --kubeconfig "$STATE_DIR/kubeconfig" >&2 || true
  /usr/bin/docker rm -f "$KIND_CLUSTER-s3" >/dev/null 2>&1 || true
fi
bash "$HERE/dockerd.sh" stop

#!/usr/bin/env bash
# The same end-to-end suite on kind (machines with Docker). NOT RUN HERE: see README.md.
#   bash e2e/kind/run.sh          # cluster + images + S3, then e2e/run.sh against it
#   DSCACHE_KIND_DELETE=1 ...     delete the kind cluster and the S3 container afterwards
set -Eeuo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
# shellcheck source=up.sh
source e2e/kind/up.sh
rc=0
DSCACHE_E2E_SKIP_UP=1 DSCACHE_E2E_SKIP_IMAGES=1 \
DSCACHE_E2E_KUBECTL=$KUBECTL DSCACHE_E2E_HELM=$HELM \
DSCACHE_E2E_STAGER_IMAGE=$STAGER_IMAGE DSCACHE_E2E_OPERATOR_IMAGE=$OPERATOR_IMAGE \
DSCACHE_E2E_PULL_POLICY=Never DSCACHE_E2E_CACHE_ROOT=$CACHE_ROOT \
DSCACHE_E2E_S3_ENV=/dev/null DSCACHE_E2E_S3_ENDPOINT_POD=$S3_ENDPOINT_POD \
DSCACHE_E2E_NODE_EXEC="$NODE_EXEC" \
  bash e2e/run.sh || rc=$?
if [ "${DSCACHE_KIND_DELETE:-0}" = 1 ]; then
  kind delete cluster --name "$KIND_CLUSTER"
  docker rm -f "$KIND_CLUSTER-s3" >/dev/null
fi
exit $rc

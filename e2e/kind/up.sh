#!/usr/bin/env bash
# The kind path: a kind cluster, the project's images built with `docker build`
# and loaded with `kind load docker-image`, and a real S3 server (versitygw) in
# a container on kind's Docker network.
#
# NOT RUN ON OUR MACHINES: they have no Docker daemon (see e2e/kind/README.md).
#
# Sourced by e2e/demo.sh and e2e/kind/run.sh; exports what they need:
# KUBECONFIG, KUBECTL, HELM, AWS_* keys, S3_ENDPOINT_HOST, S3_ENDPOINT_POD,
# NODE_EXEC, CACHE_ROOT, STAGER_IMAGE, OPERATOR_IMAGE.
# Needs on PATH: docker, kind (>= 0.24, node image with Kubernetes 1.34), kubectl, helm.
set -Eeuo pipefail
KIND_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KIND_CLUSTER=${DSCACHE_KIND_CLUSTER:-dscache-e2e}
KIND_NODE_IMAGE=${DSCACHE_KIND_NODE_IMAGE:-kindest/node:v1.34.0}
S3_IMAGE=${DSCACHE_KIND_S3_IMAGE:-versity/versitygw:v1.0.18}
S3_CONTAINER=$KIND_CLUSTER-s3
STATE_DIR=${DSCACHE_KIND_STATE:-$HOME/.cache/dscache/kind}
mkdir -p "$STATE_DIR"
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "e2e/kind: $tool is not on PATH" >&2; exit 1; }
done

export KUBECONFIG=$STATE_DIR/kubeconfig
if ! kind get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER"; then
  kind create cluster --name "$KIND_CLUSTER" --image "$KIND_NODE_IMAGE" --kubeconfig "$KUBECONFIG" --wait 120s
fi
KUBECTL=$(command -v kubectl)
HELM=$(command -v helm)

export STAGER_IMAGE=${STAGER_IMAGE:-localhost/dscache-stager:e2e}
export OPERATOR_IMAGE=${OPERATOR_IMAGE:-localhost/dscache-operator:e2e}
if [ "${DSCACHE_E2E_SKIP_IMAGES:-${DSCACHE_DEMO_SKIP_IMAGES:-0}}" != 1 ]; then
  docker build -f "$KIND_REPO/init-container/Dockerfile" -t "$STAGER_IMAGE" "$KIND_REPO"
  docker build -f "$KIND_REPO/operator/Dockerfile" -t "$OPERATOR_IMAGE" "$KIND_REPO"
  kind load docker-image --name "$KIND_CLUSTER" "$STAGER_IMAGE" "$OPERATOR_IMAGE"
fi

# The S3 server: versitygw's posix backend, on the `kind` network so pods reach
# it by IP (no DNS needed) and this host reaches it too (Linux: container IPs are routed).
export AWS_ACCESS_KEY_ID=dscache AWS_SECRET_ACCESS_KEY=dscache-kind-secret AWS_REGION=us-east-1
if ! docker inspect "$S3_CONTAINER" >/dev/null 2>&1; then
  docker run -d --name "$S3_CONTAINER" --network kind "$S3_IMAGE" \
    --access "$AWS_ACCESS_KEY_ID" --secret "$AWS_SECRET_ACCESS_KEY" --port :9000 posix /tmp >/dev/null
fi
S3_IP=$(docker inspect -f '{{(index .NetworkSettings.Networks "kind").IPAddress}}' "$S3_CONTAINER")
export S3_ENDPOINT_HOST=http://$S3_IP:9000 S3_ENDPOINT_POD=http://$S3_IP:9000
export AWS_ENDPOINT_URL=$S3_ENDPOINT_HOST
export NODE_EXEC="docker exec $KIND_CLUSTER-control-plane"
export CACHE_ROOT=/var/lib/dscache

#!/usr/bin/env bash
# The real workload controllers on the kind cluster, built from source here:
#   JobSet              sigs.k8s.io/jobset            (manifests: its module's config/default)
#   training-operator   github.com/kubeflow/training-operator (PyTorchJob; manifests/overlays/standalone)
# Binaries from e2e/tools/tools.sh (Go module proxy), images with docker on
# debian:bookworm-slim, `kind load`ed, manifests rendered with `kubectl kustomize`
# from the same module zips, with the image swapped for ours. Idempotent.
#
# Needs the environment e2e/kind/up.sh exports (KIND, KIND_CLUSTER, KUBECTL, KUBECONFIG).
set -Eeuo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
TOOLS=$REPO/e2e/tools/tools.sh
log() { printf '[controllers] %s\n' "$*" >&2; }
: "${KIND:?source e2e/kind/up.sh first}" "${KUBECTL:?}" "${KIND_CLUSTER:?}"

version() { sed -n "s/^$1=//p" "$TOOLS"; }
moddir() { (cd /tmp && go mod download -json "$1@$2" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p'); }

# image REF BINARY_PATH IN_IMAGE: the binary on debian:bookworm-slim (it has /tmp,
# where controller-runtime writes webhook certs), non-root as upstream runs it.
image() {
  local ref=$1 bin=$2 dest=$3 ctx
  if ! docker image inspect "$ref" >/dev/null 2>&1; then
    ctx=$(mktemp -d); cp "$bin" "$ctx/binary"
    printf 'FROM debian:bookworm-slim\nCOPY binary %s\nUSER 65532:65532\nENTRYPOINT ["%s"]\n' "$dest" "$dest" >"$ctx/Dockerfile"
    docker build -q -t "$ref" "$ctx" >/dev/null; rm -rf "$ctx"
  fi
  # `kind load docker-image` asks each node for the image's ID with `crictl inspecti`;
  # our node image has no crictl, so kind would load it again on every call (~20 s each
  # on 2 cores): a marker (cluster container id + image id) says it is already there.
  local stamp marker
  stamp="$(docker inspect -f '{{.Id}}' "$KIND_CLUSTER-control-plane") $(docker image inspect -f '{{.Id}}' "$ref")"
  marker=${DSCACHE_KIND_STATE:-$HOME/.cache/dscache/kind}/loaded/$(echo "$ref" | tr '/:' '__')
  if [ "$(cat "$marker" 2>/dev/null)" = "$stamp" ]; then log "$ref already loaded on every node"; return; fi
  "$KIND" load docker-image --name "$KIND_CLUSTER" "$ref" >/dev/null
  mkdir -p "$(dirname "$marker")"; echo "$stamp" >"$marker"
}

jobset() {
  local v; v=$(version JOBSET_VERSION)
  local ref=dscache.local/jobset:$v bin; bin=$(bash "$TOOLS" --path jobset | tail -n1)
  image "$ref" "$bin/manager" /manager
  "$KUBECTL" kustomize "$(moddir sigs.k8s.io/jobset "$v")/config/default" |
    sed -E "s#image: [^ ]*/jobset/jobset:.*#image: $ref#" |
    "$KUBECTL" apply --server-side --force-conflicts -f - >/dev/null
  # Its manifest requests half a core: on a 2-core kind node that, with the control plane and
  # dscache's two controller replicas, leaves no room for a 500m pre-stage pod there (OutOfcpu).
  "$KUBECTL" -n jobset-system set resources deploy/jobset-controller-manager --requests=cpu=50m >/dev/null
  "$KUBECTL" -n jobset-system rollout status deploy/jobset-controller-manager --timeout=180s >&2
  log "JobSet $v ready"
}

training_operator() {
  local v; v=$(version TRAINING_OPERATOR_VERSION)
  local ref=dscache.local/training-operator:$v bin; bin=$(bash "$TOOLS" --path training-operator | tail -n1)
  image "$ref" "$bin/training-operator.v1" /manager
  "$KUBECTL" kustomize "$(moddir github.com/kubeflow/training-operator "$v")/manifests/overlays/standalone" |
    sed -E "s#image: kubeflow/training-operator:.*#image: $ref#" |
    "$KUBECTL" apply --server-side --force-conflicts -f - >/dev/null
  "$KUBECTL" -n kubeflow rollout status deploy/training-operator --timeout=180s >&2
  log "training-operator $v ready"
}

for c in ${DSCACHE_KIND_CONTROLLERS:-jobset training-operator}; do
  case $c in
    jobset) jobset ;;
    training-operator) training_operator ;;
    none) ;;
    *) echo "unknown controller $c (jobset, training-operator, none)" >&2; exit 2 ;;
  esac
done

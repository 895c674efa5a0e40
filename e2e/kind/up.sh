#!/usr/bin/env bash
# The kind path: a 3-node kind cluster (1 control plane + 2 workers, all three
# run pods), the project's images from their real Dockerfiles, and a real S3
# server (versitygw) in a container on kind's Docker network.
#
# With no registry (our CI machines), everything is built here:
#   dockerd        e2e/kind/dockerd.sh (Debian's docker.io; started if no Docker answers)
#   kind           e2e/tools/tools.sh kind (Go module proxy)
#   node image     e2e/kind/node-image.sh (kind's base Dockerfile + our binaries + preloaded images)
#   pod network    ptp + host-local + a route per node (kindnetd's recipe, without its daemon)
#   project images e2e/tools/images.sh (buildah, the real Dockerfiles) -> `kind load image-archive`
#   S3             versitygw from tools.sh in a local image
# With internet, set DSCACHE_KIND_NODE_IMAGE=kindest/node:v1.34.0: kind pulls it and
# installs its own CNI (kindnetd) and CoreDNS as usual.
#
# Sourced by e2e/run.sh and e2e/demo.sh; exports KUBECONFIG, KUBECTL, HELM, KIND,
# KIND_CLUSTER, AWS_* keys, S3_ENDPOINT_HOST, S3_ENDPOINT_POD, NODE_EXEC, CACHE_ROOT,
# STAGER_IMAGE, OPERATOR_IMAGE, KIND_NODES.
set -Eeuo pipefail
KIND_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KIND_CLUSTER=${DSCACHE_KIND_CLUSTER:-dscache-e2e}
KIND_WORKERS=${DSCACHE_KIND_WORKERS:-2}
STATE_DIR=${DSCACHE_KIND_STATE:-$HOME/.cache/dscache/kind}
S3_CONTAINER=$KIND_CLUSTER-s3
_tools=$KIND_REPO/e2e/tools/tools.sh
_t0=$SECONDS
klog() { printf '[kind %4ds] %s\n' "$((SECONDS - _t0))" "$*" >&2; }
mkdir -p "$STATE_DIR/bin"

# Docker: Debian's CLI (it has buildx); kind calls `docker` from PATH.
if ! /usr/bin/docker info >/dev/null 2>&1; then bash "$KIND_REPO/e2e/kind/dockerd.sh" start; fi
ln -sf /usr/bin/docker "$STATE_DIR/bin/docker"
export PATH=$STATE_DIR/bin:$PATH
KIND=$(bash "$_tools" --path kind | tail -n1)/kind
KUBECTL=$(bash "$_tools" --path kubernetes | tail -n1)/kubectl
HELM=$(bash "$_tools" --path helm | tail -n1)/helm
export KIND KUBECTL HELM KIND_CLUSTER
export KUBECONFIG=$STATE_DIR/kubeconfig

if [ -n "${DSCACHE_KIND_NODE_IMAGE:-}" ]; then
  KIND_NODE_IMAGE=$DSCACHE_KIND_NODE_IMAGE; _local_node=false
else
  KIND_NODE_IMAGE=$(bash "$KIND_REPO/e2e/kind/node-image.sh"); _local_node=true
fi

kind_config() {
  local etcd_tag; etcd_tag=$(sed -n 's/^ETCD_VERSION=//p' "$_tools")
  echo "kind: Cluster"
  echo "apiVersion: kind.x-k8s.io/v1alpha4"
  echo "nodes:"
  echo "- role: control-plane"
  for _ in $(seq "$KIND_WORKERS"); do echo "- role: worker"; done
  $_local_node || return 0
  cat <<YAML
networking:
  disableDefaultCNI: true      # no kindnetd image here: up.sh wires ptp + routes
kubeadmConfigPatches:
- |
  kind: ClusterConfiguration
  etcd:
    local:
      imageTag: $etcd_tag      # the etcd tools.sh builds, tagged with its own version
- |
  kind: InitConfiguration
  skipPhases: [preflight, addon/coredns]   # no CoreDNS image; nothing here resolves names
YAML
}

# A cluster is reused only within one lifetime of its node containers: after a dockerd or
# machine restart (or a run killed mid-test) the routes pod-network.sh wired and the pods'
# state are gone, and such a cluster fails later in confusing ways. The marker holds every
# node container's start time, recorded when the cluster was made; DSCACHE_KIND_FRESH=1
# (.ci/run) always starts from a new cluster.
_lifetime() { docker ps -q --filter "label=io.x-k8s.kind.cluster=$KIND_CLUSTER" | sort |
  xargs -r docker inspect -f '{{.Name}} {{.State.StartedAt}}' 2>/dev/null | sort; }
_marker_file=$STATE_DIR/$KIND_CLUSTER.lifetime
if "$KIND" get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER"; then
  _why=
  if [ "${DSCACHE_KIND_FRESH:-0}" = 1 ]; then _why="DSCACHE_KIND_FRESH=1"
  elif [ "$(_lifetime)" != "$(cat "$_marker_file" 2>/dev/null)" ]; then
    _why="its node containers restarted or stopped since it was made"
  elif [ "$("$KUBECTL" get nodes --no-headers 2>/dev/null | awk '$2 ~ /^Ready/' | wc -l)" != "$((KIND_WORKERS + 1))" ]; then
    _why="not all of its $((KIND_WORKERS + 1)) nodes are registered and Ready"
  fi
  if [ -n "$_why" ]; then
    klog "deleting cluster $KIND_CLUSTER: $_why"
    "$KIND" delete cluster --name "$KIND_CLUSTER" --kubeconfig "$KUBECONFIG" >&2
    docker rm -f "$S3_CONTAINER" >/dev/null 2>&1 || true
  fi
fi
if ! "$KIND" get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER"; then
  kind_config >"$STATE_DIR/kind-config.yaml"
  klog "kind create cluster $KIND_CLUSTER ($KIND_NODE_IMAGE, 1 control plane + $KIND_WORKERS workers)"
  _w=(); $_local_node || _w=(--wait 180s)
  "$KIND" create cluster --name "$KIND_CLUSTER" --image "$KIND_NODE_IMAGE" --config "$STATE_DIR/kind-config.yaml" \
    --kubeconfig "$KUBECONFIG" "${_w[@]}"
  if $_local_node; then bash "$KIND_REPO/e2e/kind/pod-network.sh"; fi
  # Three nodes that run pods: the control plane takes workloads too.
  "$KUBECTL" taint nodes --all node-role.kubernetes.io/control-plane- >/dev/null 2>&1 || true
  _lifetime >"$_marker_file"
fi
"$KUBECTL" wait --for=condition=Ready nodes --all --timeout=180s >/dev/null
mapfile -t KIND_NODES < <("$KUBECTL" get nodes -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}')
export KIND_NODES_LIST="${KIND_NODES[*]}"
klog "nodes Ready: ${KIND_NODES[*]}"

# Each node's cache root on a small size-limited filesystem of its own (1 GiB tmpfs), as a
# node's NVMe would be: the node agents' budgets and free-space checks meet a real limit
# (test_capacity_lru), and nothing the suite stages can fill the machine's disk.
for _n in "${KIND_NODES[@]}"; do
  docker exec "$_n" sh -c 'mkdir -p /var/lib/dscache && { grep -qs " /var/lib/dscache " /proc/mounts ||
    mount -t tmpfs -o size='"${DSCACHE_KIND_CACHE_SIZE:-1g}"',mode=0755 dscache-cache /var/lib/dscache; }'
done

# Controllers and tests that take a node away rewire it with this when it comes back.
if $_local_node; then export KIND_REJOIN_CMD="bash $KIND_REPO/e2e/kind/pod-network.sh"; else export KIND_REJOIN_CMD=true; fi

# The project's images, from the real Dockerfiles (buildah: RUN steps may need
# the build CA, see images.sh), loaded into every node. images.sh reuses an
# archive whose inputs did not change; a node is loaded again only if the
# archive changed or the cluster is new (marker: cluster container id + input key).
export STAGER_IMAGE=${STAGER_IMAGE:-localhost/dscache-stager:kind}
export OPERATOR_IMAGE=${OPERATOR_IMAGE:-localhost/dscache-operator:kind}
if [ "${DSCACHE_E2E_SKIP_IMAGES:-${DSCACHE_DEMO_SKIP_IMAGES:-0}}" != 1 ]; then
  _cluster_id=$(docker inspect -f '{{.Id}}' "$KIND_CLUSTER-control-plane")
  mkdir -p "$STATE_DIR/loaded"
  for _spec in "$STAGER_IMAGE init-container/Dockerfile" "$OPERATOR_IMAGE operator/Dockerfile"; do
    read -r _ref _df <<<"$_spec"
    _archive=$(bash "$KIND_REPO/e2e/tools/images.sh" build "$_ref" "$KIND_REPO/$_df" "$KIND_REPO" | tail -n1)
    _marker=$STATE_DIR/loaded/$(basename "$_archive" .oci.tar)
    _stamp="$_cluster_id $(cat "${_archive%.oci.tar}.key")"
    if [ "$(cat "$_marker" 2>/dev/null)" = "$_stamp" ]; then
      klog "$_ref already loaded on every node"
    else
      "$KIND" load image-archive --name "$KIND_CLUSTER" "$_archive"
      echo "$_stamp" >"$_marker"
    fi
  done
fi

# The S3 server: versitygw (built by tools.sh) in a local image, on the `kind`
# network: pods reach it by container IP (masqueraded by their node), and so does this host.
export AWS_ACCESS_KEY_ID=dscache AWS_SECRET_ACCESS_KEY=dscache-kind-secret AWS_REGION=us-east-1
S3_IMAGE=${DSCACHE_KIND_S3_IMAGE:-}
if [ -z "$S3_IMAGE" ]; then
  _gw=$(bash "$_tools" --path s3 | tail -n1)
  S3_IMAGE=dscache.local/versitygw:$(basename "$(dirname "$_gw")" | sed 's/^versitygw-//')
  if ! docker image inspect "$S3_IMAGE" >/dev/null 2>&1; then
    _ctx=$(mktemp -d); cp "$_gw/versitygw" "$_ctx/"
    printf 'FROM debian:bookworm-slim\nCOPY versitygw /usr/local/bin/versitygw\nRUN mkdir -p /data\nENTRYPOINT ["/usr/local/bin/versitygw"]\n' >"$_ctx/Dockerfile"
    docker build -q -t "$S3_IMAGE" "$_ctx" >/dev/null; rm -rf "$_ctx"
  fi
fi
if [ "$(docker inspect -f '{{.State.Running}}' "$S3_CONTAINER" 2>/dev/null)" != true ]; then
  docker rm -f "$S3_CONTAINER" >/dev/null 2>&1 || true
  docker run -d --name "$S3_CONTAINER" --network kind "$S3_IMAGE" \
    --access "$AWS_ACCESS_KEY_ID" --secret "$AWS_SECRET_ACCESS_KEY" --port :9000 posix /data >/dev/null
fi
S3_IP=$(docker inspect -f '{{(index .NetworkSettings.Networks "kind").IPAddress}}' "$S3_CONTAINER")
export S3_ENDPOINT_HOST=http://$S3_IP:9000 S3_ENDPOINT_POD=http://$S3_IP:9000
export AWS_ENDPOINT_URL=$S3_ENDPOINT_HOST
for _ in $(seq 50); do curl -s -o /dev/null --noproxy '*' "$S3_ENDPOINT_HOST/" && break; sleep 0.2; done
# `{node}` is replaced by the node's name (e2e/support: node_path_exists(node, path)).
export NODE_EXEC="docker exec {node}"
export CACHE_ROOT=/var/lib/dscache
klog "up: $KIND_CLUSTER, S3 $S3_ENDPOINT_HOST"

#!/usr/bin/env bash
# Build kind's node image here, with no registry: every binary and image in it
# is built from source on this machine.
#
#   e2e/kind/node-image.sh            build (skipped if $NODE_IMAGE exists) and print the image name
#   e2e/kind/node-image.sh --force    rebuild
#
# Steps (each logs its time):
#   1. debian:bookworm-slim = the project's debootstrap rootfs (e2e/tools/images.sh base), `docker import`ed
#   2. kind's own `images/base` Dockerfile (from the kind module zip), `--target base`, built offline
#   3. + containerd, ctr, the runc shim v2, runc (tools.sh) behind node/runc-wrapper, Debian's CNI plugins,
#      kubeadm, kubelet, kubectl (tools.sh), /kind/version
#   4. images kubeadm runs, built with docker from tools.sh's binaries: kube-apiserver,
#      kube-controller-manager, kube-scheduler, kube-proxy (+ iptables), etcd, pause;
#      imported into the node's containerd like `kind build node-image` does, then `docker commit`.
# kindnetd and CoreDNS are not in the image: e2e/kind/up.sh installs a CNI
# config of its own (ptp + host-local + routes, kindnetd's recipe) and skips CoreDNS.
set -Eeuo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TOOLS=$REPO/e2e/tools/tools.sh
DOCKER=/usr/bin/docker
export DOCKER_BUILDKIT=1
K8S_VERSION=$(sed -n 's/^K8S_VERSION=//p' "$TOOLS")
KIND_VERSION=$(sed -n 's/^KIND_VERSION=\([^ ]*\).*/\1/p' "$TOOLS")
PAUSE_VERSION=$(sed -n 's/^PAUSE_VERSION=\([^ ]*\).*/\1/p' "$TOOLS")
ETCD_VERSION=$(sed -n 's/^ETCD_VERSION=//p' "$TOOLS")
NODE_IMAGE=${DSCACHE_KIND_LOCAL_NODE_IMAGE:-dscache.local/kind-node:$K8S_VERSION-kind$KIND_VERSION}
BASE_IMAGE=dscache.local/kind-base:$KIND_VERSION
# etcd is tagged with its real version; up.sh tells kubeadm (ClusterConfiguration imageTag).
ETCD_IMAGE=registry.k8s.io/etcd:$ETCD_VERSION
T0=$SECONDS
log() { printf '[node-image %4ds] %s\n' "$((SECONDS - T0))" "$*" >&2; }
timed() { local what=$1 t=$SECONDS; shift; "$@"; log "$what: $((SECONDS - t))s"; }
has_image() { $DOCKER image inspect "$1" >/dev/null 2>&1; }

if [ "${1:-}" != --force ] && has_image "$NODE_IMAGE"; then echo "$NODE_IMAGE"; exit 0; fi

tool() { bash "$TOOLS" --path "$1" | tail -n1; }
K8S_BIN=$(tool kubernetes); KUBEADM_BIN=$(tool kubeadm); ETCD_BIN=$(tool etcd)
CONTAINERD_BIN=$(tool containerd); RUNC_BIN=$(tool runc); PAUSE_BIN=$(tool pause); CNI_BIN=$(tool cni)
KIND_SRC=$(cd /tmp && go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
WORK=$(mktemp -d /tmp/dscache-node-image.XXXX)
BUILD_CTR=""
cleanup() { [ -z "$BUILD_CTR" ] || $DOCKER rm -f "$BUILD_CTR" >/dev/null 2>&1; rm -rf "$WORK"; }
trap cleanup EXIT

# 1. The FROM image of kind's base Dockerfile, from our own debootstrap rootfs.
debian_base() {
  local tar label
  tar=$(ls -t "${DSCACHE_IMAGES_CACHE:-$HOME/.cache/dscache/images}"/debian-bookworm-minbase-*.tar 2>/dev/null | head -n1 || true)
  [ -n "$tar" ] || { bash "$REPO/e2e/tools/images.sh" base >&2; tar=$(ls -t "${DSCACHE_IMAGES_CACHE:-$HOME/.cache/dscache/images}"/debian-bookworm-minbase-*.tar | head -n1); }
  label=$($DOCKER image inspect -f '{{index .Config.Labels "dscache.base"}}' debian:bookworm-slim 2>/dev/null || true)
  [ "$label" = "$(basename "$tar")" ] && return
  $DOCKER import --change 'CMD ["/bin/bash"]' --change "LABEL dscache.base=$(basename "$tar")" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' "$tar" debian:bookworm-slim >/dev/null
}

# 2. kind's base stage: systemd, iptables, mount tools... from Debian (apt over --network host).
kind_base() {
  has_image "$BASE_IMAGE" && return
  $DOCKER build --network host --target base --build-arg BASE_IMAGE=debian:bookworm-slim \
    -t "$BASE_IMAGE" "$KIND_SRC/images/base" >"$WORK/base.log" 2>&1 || { tail -n 30 "$WORK/base.log" >&2; exit 1; }
}

# 4a. A FROM-scratch image around static binaries (docker save format, for ctr import).
scratch_image() {  # REF BINARY...
  local ref=$1; shift
  local ctx; ctx=$(mktemp -d "$WORK/img.XXXX")
  cp "$@" "$ctx/"
  {
    echo "FROM scratch"
    for b in "$@"; do echo "COPY $(basename "$b") /usr/local/bin/$(basename "$b")"; done
    echo "ENV PATH=/usr/local/bin:/usr/bin:/bin"
    echo "ENTRYPOINT [\"/usr/local/bin/$(basename "$1")\"]"
  } >"$ctx/Dockerfile"
  $DOCKER build -q -t "$ref" "$ctx" >/dev/null
}

# kube-proxy programs iptables: Debian's iptables, and a wrapper that picks the
# backend (legacy or nft) the node already uses, as upstream's iptables-wrapper does.
kube_proxy_image() {
  local ref=$1 ctx; ctx=$(mktemp -d "$WORK/img.XXXX")
  cp "$K8S_BIN/kube-proxy" "$HERE/node/iptables-wrapper" "$ctx/"
  cat >"$ctx/Dockerfile" <<'DF'
FROM debian:bookworm-slim
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iptables conntrack \
 && rm -rf /var/lib/apt/lists/*
COPY iptables-wrapper /usr/sbin/iptables-wrapper
RUN for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do \
      ln -sf iptables-wrapper /usr/sbin/$t; done
COPY kube-proxy /usr/local/bin/kube-proxy
ENTRYPOINT ["/usr/local/bin/kube-proxy"]
DF
  $DOCKER build -q --network host -t "$ref" "$ctx" >/dev/null
}

# 3. The node filesystem on top of kind's base.
node_stage() {
  local ctx=$WORK/node
  mkdir -p "$ctx/bin" "$ctx/cni" "$ctx/k8s"
  cp "$CONTAINERD_BIN"/{containerd,ctr,containerd-shim-runc-v2} "$RUNC_BIN/runc" "$HERE/node/runc-wrapper" "$ctx/bin/"
  cp "$CNI_BIN"/{host-local,loopback,ptp,portmap,bridge} "$ctx/cni/"
  cp "$KUBEADM_BIN/kubeadm" "$K8S_BIN"/{kubelet,kubectl} "$ctx/k8s/"
  cp "$HERE/node/default-storage.yaml" "$ctx/"
  cat >"$ctx/Dockerfile" <<DF
FROM $BASE_IMAGE
COPY bin/containerd bin/ctr bin/containerd-shim-runc-v2 /usr/local/bin/
# runc behind a wrapper: see e2e/kind/node/runc-wrapper (oom_score_adj and capabilities on our hosts).
COPY bin/runc /usr/local/sbin/runc.real
COPY bin/runc-wrapper /usr/local/sbin/runc
COPY cni/ /opt/cni/bin/
COPY k8s/ /usr/bin/
COPY default-storage.yaml /kind/manifests/default-storage.yaml
# As kind's own final stage does; the sandbox image is the pause we build.
RUN ctr oci spec \
      | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
      | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \
 && sed -i 's#sandbox_image = .*#sandbox_image = "registry.k8s.io/pause:$PAUSE_VERSION"#' /etc/containerd/config.toml \
 && echo "$K8S_VERSION" > /kind/version \
 && containerd --version && runc --version && kubeadm version -o short
DF
  $DOCKER build -q -t "$NODE_IMAGE-stage" "$ctx" >/dev/null
}

# 4b. Preload: containerd in a build container imports the images, then commit.
preload() {
  local refs=("$@") tar=$WORK/images.tar
  $DOCKER save -o "$tar" "${refs[@]}"
  BUILD_CTR=$($DOCKER run -d --privileged --entrypoint sleep "$NODE_IMAGE-stage" infinity)
  $DOCKER exec "$BUILD_CTR" bash -c 'nohup containerd >/dev/null 2>&1 & for i in $(seq 50); do [ -S /run/containerd/containerd.sock ] && ctr info >/dev/null 2>&1 && exit 0; sleep 0.2; done; exit 1'
  $DOCKER exec -i "$BUILD_CTR" ctr -n k8s.io images import --label=io.cri-containerd.pinned=pinned --no-unpack --digests - <"$tar" >/dev/null
  $DOCKER exec -i "$BUILD_CTR" ctr -n k8s.io images import --label=io.cri-containerd.pinned=pinned --no-unpack --digests - <"$PAUSE_BIN/pause.oci.tar" >/dev/null
  $DOCKER exec "$BUILD_CTR" ctr -n k8s.io images list -q | grep -v '^sha256:' >&2
  $DOCKER exec "$BUILD_CTR" bash -c 'pkill containerd; for i in $(seq 50); do pgrep containerd >/dev/null || exit 0; sleep 0.2; done'
  $DOCKER commit --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' "$BUILD_CTR" "$NODE_IMAGE" >/dev/null
  $DOCKER rm -f "$BUILD_CTR" >/dev/null; BUILD_CTR=""
  $DOCKER rmi "$NODE_IMAGE-stage" "${refs[@]}" >/dev/null 2>&1 || true
}

timed "debian:bookworm-slim from the debootstrap rootfs" debian_base
timed "kind base image $BASE_IMAGE" kind_base
timed "node filesystem" node_stage
r=registry.k8s.io
for c in kube-apiserver kube-controller-manager kube-scheduler; do
  timed "$c image" scratch_image "$r/$c:$K8S_VERSION" "$K8S_BIN/$c"
done
timed "kube-proxy image" kube_proxy_image "$r/kube-proxy:$K8S_VERSION"
timed "etcd image" scratch_image "$ETCD_IMAGE" "$ETCD_BIN/etcd"
timed "preload and commit" preload "$r/kube-apiserver:$K8S_VERSION" "$r/kube-controller-manager:$K8S_VERSION" \
  "$r/kube-scheduler:$K8S_VERSION" "$r/kube-proxy:$K8S_VERSION" "$ETCD_IMAGE"
log "$NODE_IMAGE: $($DOCKER image inspect -f '{{.Size}}' "$NODE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
echo "$NODE_IMAGE"

#!/usr/bin/env bash
# Build the third-party binaries the tests, benchmarks and the kind cluster need,
# from source through the Go module proxy, into a cache outside the repo keyed
# by version. Re-running is cheap: a tool whose binaries exist is skipped.
#
#   e2e/tools/tools.sh [TOOL...]     build TOOLs (default: all) and print their bin dirs
#   e2e/tools/tools.sh --path TOOL   print TOOL's bin dir (building it if missing)
#
# TOOL is one of: s3 s5cmd etcd kube-apiserver kubernetes containerd runc helm
#                  cni pause kind kubeadm
#   kind     sigs.k8s.io/kind (the kind path, e2e/kind/)
#   kubeadm  kubeadm of $K8S_VERSION, apart from `kubernetes` so that adding it
#            did not change that cache key; kind's node image needs it
#   helm-docs   the chart README from values.yaml (github.com/norwoodj/helm-docs)
#   actionlint  checks .github/workflows (github.com/rhysd/actionlint)
#   toxiproxy   a latency proxy in Go whose cost does not depend on the client
#               (github.com/Shopify/toxiproxy): bench/stager.py's wan profile
#   vegeta      an open-loop, constant-rate HTTP load generator in Go
#               (github.com/tsenart/vegeta): bench/operator.py's AdmissionReviews
#   csi-sanity  the CSI spec's conformance tests (github.com/kubernetes-csi/csi-test),
#               run against the node agent's CSI socket (tests/integration/test_node_csi.py)
#   jobset             the JobSet controller (sigs.k8s.io/jobset), for the kind path
#   training-operator  Kubeflow's training-operator (PyTorchJob), for the kind path
#   cni   Debian's containernetworking-plugins (bridge, host-local, portmap),
#         installed with apt-get if missing; its bin dir is /usr/lib/cni.
#   pause the pod sandbox image, compiled from the k8s.io/kubernetes module
#         zip; its bin dir holds `pause` and `pause.oci.tar` (an OCI archive
#         tagged $PAUSE_IMAGE, for `ctr -n k8s.io images import`).
set -euo pipefail

CACHE=${DSCACHE_TOOLS_DIR:-$HOME/.cache/dscache/tools}

K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.16
VERSITYGW_VERSION=v1.8.0
S5CMD_VERSION=v2.3.0
CONTAINERD_VERSION=v2.2.9
RUNC_VERSION=v1.3.6
HELM_VERSION=v3.19.5
JOBSET_VERSION=v0.10.1
TRAINING_OPERATOR_VERSION=v1.8.1
HELM_DOCS_VERSION=v1.14.2
ACTIONLINT_VERSION=v1.7.12
TOXIPROXY_VERSION=v2.12.0
VEGETA_VERSION=v12.13.0
CSI_TEST_VERSION=v5.4.0
KIND_VERSION=v0.30.0   # the last kind with cgroup v1 CI (see e2e/kind/README.md)
PAUSE_VERSION=3.10.1   # build/pause/Makefile TAG in $K8S_VERSION
# containerd 2.2's default `sandbox` image (pinned_images in its CRI config);
# the cluster's containerd config names it too, so nothing is ever pulled.
PAUSE_IMAGE=registry.k8s.io/pause:$PAUSE_VERSION

log() { printf '[tools] %s\n' "$*" >&2; }

# wrapper_module DIR REQUIRE REPLACES: a throwaway module that requires the
# tool's module, so the tool's own replace directives don't apply.
wrapper_module() {
  local dir=$1 require=$2 replaces=$3
  mkdir -p "$dir"
  cat >"$dir/go.mod" <<MOD
module dscache.local/toolbuild

go 1.24

require $require

$replaces
MOD
  printf 'package main\n' >"$dir/main.go"
}

k8s_replaces() {
  # Every staging module k8s.io/kubernetes replaces with ./staging/... is
  # pinned to the published v0.X.Y of the same release instead.
  local modfile minor
  modfile=$(cd /tmp && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  minor=${K8S_VERSION#v1.}
  echo "replace ("
  sed -n 's#^\s*\(k8s.io/[a-z0-9-]*\) => ./staging/.*#\t\1 => \1 v0.'"$minor"'#p' "$modfile"
  echo ")"
}

k8s_ldflags() {
  local v=${K8S_VERSION#v} major minor
  major=${v%%.*}; minor=${v#*.}; minor=${minor%%.*}
  local f=""
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    f+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor"
    f+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  echo "-s -w$f"
}

build_k8s() {
  # build_k8s OUT CMD... (kubelet needs cgo; the rest are static)
  local out=$1; shift
  local work; work=$(mktemp -d)
  wrapper_module "$work" "k8s.io/kubernetes $K8S_VERSION" "$(k8s_replaces)"
  (cd "$work"
   for cmd in "$@"; do
     local cgo=0; [ "$cmd" = kubelet ] && cgo=1
     log "building $cmd $K8S_VERSION (cgo=$cgo)"
     CGO_ENABLED=$cgo GOFLAGS=-mod=mod go build -trimpath -ldflags "$(k8s_ldflags)" -o "$out/$cmd" "k8s.io/kubernetes/cmd/$cmd"
   done)
  rm -rf "$work"
}

build_etcd() {
  local out=$1 work; work=$(mktemp -d)
  wrapper_module "$work" "go.etcd.io/etcd/server/v3 $ETCD_VERSION" "replace (
	go.etcd.io/etcd/api/v3 => go.etcd.io/etcd/api/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/pkg/v3 => go.etcd.io/etcd/client/pkg/v3 $ETCD_VERSION
	go.etcd.io/etcd/client/v3 => go.etcd.io/etcd/client/v3 $ETCD_VERSION
	go.etcd.io/etcd/pkg/v3 => go.etcd.io/etcd/pkg/v3 $ETCD_VERSION
)"
  (cd "$work" && log "building etcd $ETCD_VERSION" &&
   CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3)
  rm -rf "$work"
}

go_install() {
  # go_install OUT MODULE VERSION PKG [extra go flags...]
  # Built from a wrapper module rather than `go install PKG@VERSION`, because
  # the proxy refuses the version list some modules' deprecation check needs
  # (s5cmd v2 answers 403). $GO_LDFLAGS is appended to the default ldflags
  # (a second -ldflags flag would replace them, not add to them).
  local out=$1 module=$2 version=$3 pkg=$4; shift 4
  local work; work=$(mktemp -d)
  wrapper_module "$work" "$module $version" ""
  log "building $pkg@$version"
  (cd "$work" && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w ${GO_LDFLAGS:-}" "$@" -o "$out/" "$pkg")
  rm -rf "$work"
}

build_containerd() {
  # containerd, ctr and the runc shim. CGO off: with cgo on, the btrfs
  # snapshotter is compiled in and needs libbtrfs headers; we use overlayfs.
  local out=$1 m=github.com/containerd/containerd/v2 c
  for c in containerd ctr containerd-shim-runc-v2; do
    CGO_ENABLED=0 GO_LDFLAGS="-X $m/version.Version=$CONTAINERD_VERSION" \
      go_install "$out" $m "$CONTAINERD_VERSION" "$m/cmd/$c" -tags no_btrfs
  done
}

build_runc() {
  # runc needs cgo and libseccomp for its seccomp filter support.
  local out=$1
  if ! pkg-config --exists libseccomp 2>/dev/null; then
    log "installing libseccomp-dev and pkg-config (runc links libseccomp)"
    apt_install libseccomp-dev pkg-config
  fi
  CGO_ENABLED=1 GO_LDFLAGS="-X main.version=${RUNC_VERSION#v}" \
    go_install "$out" github.com/opencontainers/runc "$RUNC_VERSION" github.com/opencontainers/runc -tags seccomp
}

apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2 || {
    apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2; }
}

ensure_cni() {
  # Debian's plugins land in /usr/lib/cni; nothing is copied into the cache.
  local p
  for p in bridge host-local portmap loopback; do
    [ -x /usr/lib/cni/$p ] || { log "installing containernetworking-plugins"; apt_install containernetworking-plugins; break; }
  done
  echo /usr/lib/cni
}

build_helm() {
  # Stamped like helm's own Makefile: without k8sVersion*, `helm template`
  # and `helm lint` assume Kubernetes v1.20 (Capabilities.KubeVersion), which
  # fails charts with a kubeVersion constraint. The minor comes from helm's
  # own client-go requirement, as upstream does it.
  local out=$1 modfile minor
  modfile=$(cd /tmp && go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  minor=$(sed -n 's#^\s*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$modfile" | head -n1)
  GO_LDFLAGS="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean
    -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor
    -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor" \
    go_install "$out" helm.sh/helm/v3 "$HELM_VERSION" helm.sh/helm/v3/cmd/helm
}

build_pause() {
  # The sandbox ("pause") image from Kubernetes' own pause.c, compiled static
  # and wrapped as a one-layer FROM-scratch OCI archive. No registry needed.
  local out=$1 src
  src=$(cd /tmp && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')
  log "compiling pause $PAUSE_VERSION from $src/build/pause/linux/pause.c"
  gcc -Os -Wall -Werror -static -DVERSION="v$PAUSE_VERSION-$K8S_VERSION" \
    -o "$out/pause" "$src/build/pause/linux/pause.c"
  python3 "$(dirname "$0")/oci_image.py" --binary "$out/pause" --ref "$PAUSE_IMAGE" \
    --user 65535:65535 --out "$out/pause.oci.tar"
}

tool_version() {
  case $1 in
    s3) echo "versitygw-$VERSITYGW_VERSION" ;;
    s5cmd) echo "s5cmd-$S5CMD_VERSION" ;;
    etcd) echo "etcd-$ETCD_VERSION" ;;
    kube-apiserver) echo "kube-apiserver-$K8S_VERSION" ;;
    kubernetes) echo "kubernetes-$K8S_VERSION" ;;
    containerd) echo "containerd-$CONTAINERD_VERSION" ;;
    runc) echo "runc-$RUNC_VERSION" ;;
    helm) echo "helm-$HELM_VERSION-stamped" ;;   # -stamped: see build_helm
    pause) echo "pause-$PAUSE_VERSION-$K8S_VERSION" ;;
    kind) echo "kind-$KIND_VERSION" ;;
    kubeadm) echo "kubeadm-$K8S_VERSION" ;;
    jobset) echo "jobset-$JOBSET_VERSION" ;;
    training-operator) echo "training-operator-$TRAINING_OPERATOR_VERSION" ;;
    helm-docs) echo "helm-docs-$HELM_DOCS_VERSION" ;;
    actionlint) echo "actionlint-$ACTIONLINT_VERSION" ;;
    toxiproxy) echo "toxiproxy-$TOXIPROXY_VERSION" ;;
    vegeta) echo "vegeta-$VEGETA_VERSION" ;;
    csi-sanity) echo "csi-sanity-$CSI_TEST_VERSION" ;;
    *) echo "unknown tool: $1 (one of: s3 s5cmd etcd kube-apiserver kubernetes containerd runc helm cni pause kind kubeadm jobset training-operator helm-docs actionlint toxiproxy vegeta csi-sanity)" >&2; exit 2 ;;
  esac
}

build_tool() {
  local tool=$1 dir
  if [ "$tool" = cni ]; then ensure_cni; return; fi
  dir="$CACHE/$(tool_version "$tool")"
  # The full Kubernetes set contains the apiserver and kubectl: never build them twice.
  local k8s="$CACHE/$(tool_version kubernetes)"
  if [ "$tool" = kube-apiserver ] && [ -f "$k8s/.done" ]; then echo "$k8s/bin"; return; fi
  if [ -f "$dir/.done" ] && { [ "$tool" != kube-apiserver ] || [ -x "$dir/bin/kubectl" ]; }; then
    echo "$dir/bin"; return
  fi
  rm -rf "$dir.tmp"; mkdir -p "$dir.tmp/bin"
  local out="$dir.tmp/bin" start=$SECONDS
  case $tool in
    s3) go_install "$out" github.com/versity/versitygw "$VERSITYGW_VERSION" github.com/versity/versitygw/cmd/versitygw ;;
    s5cmd) go_install "$out" github.com/peak/s5cmd/v2 "$S5CMD_VERSION" github.com/peak/s5cmd/v2 ;;
    etcd) build_etcd "$out" ;;
    # The integration tier's control plane: the apiserver, and kubectl to poke it.
    kube-apiserver) build_k8s "$out" kube-apiserver kubectl ;;
    kubernetes)
      local cmds=(kube-controller-manager kube-scheduler kube-proxy kubectl kubelet)
      local api="$CACHE/$(tool_version kube-apiserver)"
      if [ -f "$api/.done" ] && [ -x "$api/bin/kubectl" ]; then
        log "reusing $api/bin/kube-apiserver and kubectl"
        cp "$api/bin/kube-apiserver" "$api/bin/kubectl" "$out/"
        cmds=(kube-controller-manager kube-scheduler kube-proxy kubelet)
      else
        cmds=(kube-apiserver "${cmds[@]}")
      fi
      build_k8s "$out" "${cmds[@]}" ;;
    containerd) build_containerd "$out" ;;
    runc) build_runc "$out" ;;
    helm) build_helm "$out" ;;
    pause) build_pause "$out" ;;
    kind) CGO_ENABLED=0 go_install "$out" sigs.k8s.io/kind "$KIND_VERSION" sigs.k8s.io/kind ;;
    kubeadm) build_k8s "$out" kubeadm ;;
    # The module root is the manager (main.go); renamed as in JobSet's own image.
    jobset) CGO_ENABLED=0 go_install "$out" sigs.k8s.io/jobset "$JOBSET_VERSION" sigs.k8s.io/jobset &&
      mv "$out/jobset" "$out/manager" ;;
    training-operator) CGO_ENABLED=0 go_install "$out" github.com/kubeflow/training-operator "$TRAINING_OPERATOR_VERSION" \
      github.com/kubeflow/training-operator/cmd/training-operator.v1 ;;
    # Chart README and workflow checks (make tools; tests/unit/test_chart_docs.py, test_release_workflow.py).
    helm-docs) CGO_ENABLED=0 go_install "$out" github.com/norwoodj/helm-docs "$HELM_DOCS_VERSION" \
      github.com/norwoodj/helm-docs/cmd/helm-docs ;;
    actionlint) CGO_ENABLED=0 go_install "$out" github.com/rhysd/actionlint "$ACTIONLINT_VERSION" \
      github.com/rhysd/actionlint/cmd/actionlint ;;
    toxiproxy) CGO_ENABLED=0 go_install "$out" github.com/Shopify/toxiproxy/v2 "$TOXIPROXY_VERSION" \
      github.com/Shopify/toxiproxy/v2/cmd/server && mv "$out/server" "$out/toxiproxy-server" ;;
    vegeta) CGO_ENABLED=0 go_install "$out" github.com/tsenart/vegeta/v12 "$VEGETA_VERSION" github.com/tsenart/vegeta/v12 ;;
    csi-sanity) CGO_ENABLED=0 go_install "$out" github.com/kubernetes-csi/csi-test/v5 "$CSI_TEST_VERSION" \
      github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity ;;
  esac
  echo "$((SECONDS - start))" >"$dir.tmp/build-seconds"
  touch "$dir.tmp/.done"
  rm -rf "$dir"; mv "$dir.tmp" "$dir"
  log "$tool ready in $((SECONDS - start))s: $dir/bin"
  echo "$dir/bin"
}

main() {
  command -v go >/dev/null || { echo "go is required (https://go.dev/dl)" >&2; exit 1; }
  mkdir -p "$CACHE"
  if [ "${1:-}" = --path ]; then build_tool "$2"; return; fi
  local tools=("$@")
  [ ${#tools[@]} -gt 0 ] || tools=(s3 s5cmd etcd kubernetes containerd runc helm cni pause)
  for t in "${tools[@]}"; do build_tool "$t"; done
}

main "$@"

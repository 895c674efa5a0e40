# Shared settings and helpers for e2e/cluster/{up,down,status,images.sh,smoke.sh}.
# Sourced, not run.
# shellcheck disable=SC2034  # the settings are used by the scripts that source this
#
# Everything the cluster writes lives under $STATE; `down` removes it and
# everything `up` changed outside it (interfaces, iptables chains, sysctls).

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)

STATE=${DSCACHE_E2E_STATE:-/var/lib/dscache-e2e}
KUBECONFIG_OUT=$STATE/kubeconfig       # admin kubeconfig; `up` prints it
PKI=$STATE/pki
RUN=$STATE/run                         # pid files, sockets
LOGS=$STATE/logs

# The node gets an address of its own on a dummy interface: the VM may have
# no default route, and pods cannot reach the host's 127.0.0.1.
NODE_IFACE=dscache0
NODE_IP=${DSCACHE_E2E_NODE_IP:-10.251.0.1}
NODE_NAME=dscache-node
SERVICE_CIDR=10.96.0.0/16
KUBERNETES_SVC_IP=10.96.0.1
POD_CIDR=10.244.0.0/24
CLUSTER_CIDR=10.244.0.0/16
CNI_BRIDGE=dscache-cni0

# Ports. etcd is off its default ports so it never meets another etcd here;
# every listener binds the node IP or loopback, never 0.0.0.0.
ETCD_CLIENT_PORT=23790
ETCD_PEER_PORT=23800
APISERVER_PORT=6443
S3_PORT=9000
S3_ACCESS_KEY=dscache
S3_SECRET_KEY=dscache-e2e-secret
CONTAINERD_SOCK=$RUN/containerd.sock

now() { date +%s.%N; }
since() { awk -v a="$(now)" -v b="$1" 'BEGIN { printf "%.1f", a - b }'; }
T0=${T0:-$(now)}
log() { printf '[%6ss] %s\n' "$(since "$T0")" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# With `set -E`, name the command that made a script stop under `set -e`.
trap 'log "ERROR: exit $? at ${BASH_SOURCE[0]##*/}:$LINENO: $BASH_COMMAND"' ERR

# timed NAME CMD...: run CMD and log how long it took.
timed() {
  local name=$1 t; shift
  t=$(now)
  "$@"
  log "$name: done in $(since "$t")s"
}

tool_bin() { bash "$HERE/tools.sh" --path "$1" | tail -n1; }

# Resolve every binary once (building what is missing) and export paths.
resolve_tools() {
  ETCD_BIN=$(tool_bin etcd)
  K8S_BIN=$(tool_bin kubernetes)
  CONTAINERD_BIN=$(tool_bin containerd)
  RUNC_BIN=$(tool_bin runc)
  S3_BIN=$(tool_bin s3)
  PAUSE_DIR=$(tool_bin pause)
  CNI_BIN=$(tool_bin cni)
}

# pid_of NAME: pid of a component we started, if it is still that process.
pid_of() {
  local f=$RUN/$1.pid pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f")
  [ -n "$pid" ] && [ -d "/proc/$pid" ] && grep -q "$STATE" "/proc/$pid/cmdline" 2>/dev/null || return 1
  echo "$pid"
}

kubectl_() { "$K8S_BIN/kubectl" --kubeconfig "$KUBECONFIG_OUT" "$@"; }

# wait_for DESC TIMEOUT_S CMD...: poll CMD every 0.2 s until it succeeds.
wait_for() {
  local desc=$1 timeout=$2 end; shift 2
  end=$(( $(date +%s) + timeout ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || { log "timed out after ${timeout}s waiting for $desc"; return 1; }
    sleep 0.2
  done
}

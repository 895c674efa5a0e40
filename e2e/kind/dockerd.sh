#!/usr/bin/env bash
# Start or stop a dockerd of our own for the kind path (machines without a running Docker).
#
#   e2e/kind/dockerd.sh start   install docker.io if missing, start dockerd (idempotent)
#   e2e/kind/dockerd.sh stop    stop the dockerd we started; restore iptables' FORWARD policy
#
# Only a daemon this script started is ever stopped (pid file). A Docker that
# already answers `docker info` is used as it is and left alone.
# dockerd runs with runc-shim as its default runtime (see runc-shim: kind's
# privileged nodes ask for capabilities this host cannot grant).
# Docker keeps its images in $DSCACHE_DOCKER_ROOT (a cache, like the Go tools:
# the node image is built once), so stopping does not delete them.
set -Eeuo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
STATE=${DSCACHE_KIND_STATE:-$HOME/.cache/dscache/kind}
DATA_ROOT=${DSCACHE_DOCKER_ROOT:-$HOME/.cache/dscache/docker}
PIDFILE=$STATE/dockerd.pid
SAVED=$STATE/forward-policy
DOCKER=/usr/bin/docker   # Debian's CLI: it has buildx (another `docker` on PATH may not)
log() { printf '[dockerd] %s\n' "$*" >&2; }
mkdir -p "$STATE"

ours_running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

start() {
  if ! ours_running && $DOCKER info >/dev/null 2>&1; then log "a Docker daemon is already running: using it"; return; fi
  ours_running && { log "dockerd already running (pid $(cat "$PIDFILE"))"; return; }
  if ! command -v dockerd >/dev/null || [ ! -x $DOCKER ]; then
    log "installing docker.io from Debian"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io >/dev/null 2>&1 || {
      apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends docker.io >/dev/null; }
  fi
  # dockerd sets the FORWARD policy to DROP when it has to turn ip_forward on
  # itself; other clusters on this machine forward pod traffic. Keep the
  # policy as it was: remember it, turn forwarding on first, restore on stop.
  iptables -S FORWARD 2>/dev/null | sed -n 's/^-P FORWARD //p' >"$SAVED" || true
  sysctl -qw net.ipv4.ip_forward=1
  mkdir -p "$DATA_ROOT"
  dockerd --data-root "$DATA_ROOT" --exec-root "$STATE/exec" --pidfile "$PIDFILE.dockerd" \
    --add-runtime "dscache-runc=$HERE/runc-shim" --default-runtime dscache-runc \
    --host unix:///var/run/docker.sock >"$STATE/dockerd.log" 2>&1 &
  echo $! >"$PIDFILE"
  for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && { log "dockerd up (pid $(cat "$PIDFILE"), log $STATE/dockerd.log)"; restore_policy; return; }; sleep 0.5; done
  tail -n 20 "$STATE/dockerd.log" >&2; log "dockerd did not start"; exit 1
}

restore_policy() {
  local p; p=$(cat "$SAVED" 2>/dev/null || true)
  [ -n "$p" ] && iptables -P FORWARD "$p" 2>/dev/null || true
}

stop() {
  ours_running || { log "no dockerd of ours is running"; restore_policy; return; }
  local pid; pid=$(cat "$PIDFILE")
  kill "$pid"
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  rm -f "$PIDFILE"
  remove_traces
  restore_policy
  log "dockerd stopped"
}

# What dockerd leaves behind when it stops: its bridges (docker0, one br-<id>
# per network, e.g. kind's) and its iptables rules and chains. Only those are
# removed, rule by rule: other clusters' rules on this machine stay untouched.
remove_traces() {
  local ifaces=() i t rule chain
  for i in /sys/class/net/docker0 /sys/class/net/br-*; do
    [ -e "$i" ] || continue
    i=$(basename "$i")
    # br-<12 hex> is Docker's naming for user networks.
    [[ $i = docker0 || $i =~ ^br-[0-9a-f]{12}$ ]] && ifaces+=("$i")
  done
  local pat="DOCKER"; for i in "${ifaces[@]}"; do pat+="|$i"; done
  for t in filter nat; do
    iptables -t "$t" -S 2>/dev/null | grep -E -- "^-A .*($pat)" | grep -Ev '^-A DOCKER' | while read -r rule; do
      eval "iptables -t $t ${rule/#-A/-D}" 2>/dev/null || true
    done
    for chain in $(iptables -t "$t" -S 2>/dev/null | sed -n 's/^-N \(DOCKER[A-Z0-9-]*\)$/\1/p'); do
      iptables -t "$t" -F "$chain" 2>/dev/null || true
    done
    for chain in $(iptables -t "$t" -S 2>/dev/null | sed -n 's/^-N \(DOCKER[A-Z0-9-]*\)$/\1/p'); do
      iptables -t "$t" -X "$chain" 2>/dev/null || true
    done
  done
  for i in "${ifaces[@]}"; do ip link delete "$i" 2>/dev/null || true; done
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac

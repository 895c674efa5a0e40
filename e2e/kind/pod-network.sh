#!/usr/bin/env bash
# The pod network of the kind path when no kindnetd image is at hand (our
# machines): kindnetd's recipe without its daemon. For every node:
#   - a ptp + host-local CNI config for the node's podCIDR (as kindnetd writes it);
#   - a route to every other node's podCIDR via that node's IP (stale ones removed);
#   - masquerading for pod traffic leaving the pod network (to S3, to node IPs).
# Idempotent; re-run when a node (re)joins. Needs KUBECTL and KUBECONFIG.
set -Eeuo pipefail
: "${KUBECTL:?}" "${KUBECONFIG:?}"
CLUSTER_CIDR=${DSCACHE_KIND_POD_CIDR:-10.244.0.0/16}   # kind's default podSubnet
DOCKER=/usr/bin/docker
# A node that just (re)joined gets its podCIDR from the controller-manager a moment later.
for try in $(seq 60); do
  mapfile -t lines < <("$KUBECTL" get nodes -o jsonpath='{range .items[*]}{.metadata.name} {.spec.podCIDR} {.status.addresses[?(@.type=="InternalIP")].address}{"\n"}{end}')
  missing=""
  for l in "${lines[@]}"; do read -r name cidr _ <<<"$l"; [ -n "$cidr" ] || missing+=" $name"; done
  [ -z "$missing" ] && break
  [ "$try" = 60 ] && { echo "pod-network: no podCIDR after 60 s on:$missing" >&2; exit 1; }
  sleep 1
done
for l in "${lines[@]}"; do
  read -r name cidr ip <<<"$l"
  $DOCKER exec -i "$name" sh -c 'mkdir -p /etc/cni/net.d && cat >/etc/cni/net.d/10-kindnet.conflist.tmp &&
    mv /etc/cni/net.d/10-kindnet.conflist.tmp /etc/cni/net.d/10-kindnet.conflist' <<JSON
{"cniVersion": "0.3.1", "name": "kindnet", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "host-local", "dataDir": "/run/cni-ipam-state",
            "routes": [{"dst": "0.0.0.0/0"}], "ranges": [[{"subnet": "$cidr"}]]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
JSON
  want=""
  for o in "${lines[@]}"; do
    read -r other ocidr oip <<<"$o"
    [ "$other" = "$name" ] && continue
    $DOCKER exec "$name" ip route replace "$ocidr" via "$oip"
    want+=" $ocidr"
  done
  # Routes to podCIDRs that no longer exist (a node that left or rejoined with a new range).
  for r in $($DOCKER exec "$name" ip -4 route show | awk '/ via / {print $1}'); do
    case $r in 10.244.*) [[ " $want " == *" $r "* ]] || $DOCKER exec "$name" ip route del "$r" ;; esac
  done
  $DOCKER exec "$name" sh -c "iptables -t nat -C POSTROUTING -s $CLUSTER_CIDR ! -d $CLUSTER_CIDR -j MASQUERADE 2>/dev/null ||
    iptables -t nat -A POSTROUTING -s $CLUSTER_CIDR ! -d $CLUSTER_CIDR -j MASQUERADE"
done
echo "pod-network: ${#lines[@]} nodes wired" >&2

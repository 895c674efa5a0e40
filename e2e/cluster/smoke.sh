#!/usr/bin/env bash
# Prove the local cluster works end to end, after `e2e/cluster/up`:
#  - an image built from a real Dockerfile (smoke/Dockerfile: apt + pip RUN
#    steps on the debootstrap base) with buildah, imported into containerd;
#  - a pod of it (imagePullPolicy: Never, non-root) run by the real kubelet,
#    which reaches the API server at 10.96.0.1 with its service-account token,
#    reads an object from the S3 server on the node IP, and reads a hostPath;
#  - the host reaches a ClusterIP (what the API server needs for webhooks).
# Exit 0 only if all of that works. Prints timings.
#
#   e2e/cluster/smoke.sh
set -Eeuo pipefail
source "$(dirname "$0")/lib.sh"

IMAGE=localhost/dscache-smoke:v1
NS=dscache-smoke

K8S_BIN=$(tool_bin kubernetes)
S5CMD=$(tool_bin s5cmd)/s5cmd
[ -f "$KUBECONFIG_OUT" ] || die "no cluster: run e2e/cluster/up first"

fixtures() {
  # A bucket with one object, through the real S3 API.
  local f; f=$(mktemp); echo "hello from s3" >"$f"
  local creds; mapfile -t creds <"$STATE/s3.env"   # KEY=VALUE lines
  env "${creds[@]}" "$S5CMD" --endpoint-url "http://$NODE_IP:$S3_PORT" mb s3://e2e >/dev/null 2>&1 || true
  env "${creds[@]}" "$S5CMD" --endpoint-url "http://$NODE_IP:$S3_PORT" cp "$f" s3://e2e/hello.txt >/dev/null
  rm -f "$f"
  mkdir -p "$STATE/smoke-hostpath"
  echo "hello from the host" >"$STATE/smoke-hostpath/hello.txt"
}

manifest() {
  cat <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: $NS}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: pod-reader, namespace: $NS}
rules: [{apiGroups: [""], resources: [pods], verbs: [list]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: pod-reader, namespace: $NS}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}
subjects: [{kind: ServiceAccount, name: default, namespace: $NS}]
EOF
}

pod() {
  cat <<EOF
apiVersion: v1
kind: Pod
metadata: {name: probe, namespace: $NS}
spec:
  restartPolicy: Never
  containers:
  - name: probe
    image: $IMAGE
    imagePullPolicy: Never
    env:
    - {name: S3_ENDPOINT, value: "http://$NODE_IP:$S3_PORT"}
    - {name: S3_KEY, value: "$S3_ACCESS_KEY"}
    - {name: S3_SECRET, value: "$S3_SECRET_KEY"}
    volumeMounts: [{name: hostdata, mountPath: /hostdata, readOnly: true}]
  volumes:
  - name: hostdata
    hostPath: {path: $STATE/smoke-hostpath, type: Directory}
EOF
}

run_probe() {
  kubectl_ delete namespace "$NS" --ignore-not-found --wait=true >/dev/null
  manifest | kubectl_ apply -f - >/dev/null
  # The namespace's default ServiceAccount is created asynchronously.
  wait_for "serviceaccount $NS/default" 30 kubectl_ -n "$NS" get serviceaccount default
  local t phase; t=$(now)
  pod | kubectl_ apply -f - >/dev/null
  local end=$(( $(date +%s) + 120 ))
  while :; do
    phase=$(kubectl_ -n "$NS" get pod probe -o jsonpath='{.status.phase}')
    case $phase in Succeeded|Failed) break ;; esac
    [ "$(date +%s)" -lt "$end" ] || { kubectl_ -n "$NS" describe pod probe >&2; die "pod not finished after 120s"; }
    sleep 0.2
  done
  log "pod create -> $phase: $(since "$t")s"
  kubectl_ -n "$NS" logs probe | sed 's/^/    /' >&2
  [ "$phase" = Succeeded ] || die "probe pod failed"
}

host_to_clusterip() {
  # The API server calls webhooks through their Service's ClusterIP.
  curl -sf --cacert "$PKI/ca.crt" "https://$KUBERNETES_SVC_IP/version" | grep -q gitVersion ||
    die "host cannot reach https://$KUBERNETES_SVC_IP (kube-proxy OUTPUT rules?)"
  log "host -> ClusterIP $KUBERNETES_SVC_IP: ok"
}

main() {
  fixtures
  timed "image $IMAGE" "$HERE/images.sh" build "$IMAGE" "$HERE/smoke/Dockerfile" "$HERE/smoke"
  host_to_clusterip
  run_probe
  kubectl_ delete namespace "$NS" --wait=false >/dev/null
  log "smoke test passed in $(since "$T0")s"
}

main "$@"

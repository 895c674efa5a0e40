#!/usr/bin/env bash
# make demo: from a fresh machine to "a training Job read its dataset from local disk".
#
#   1. a 3-node kind cluster (e2e/kind/up.sh: our own dockerd, everything built here)
#   2. the project's images, built from its Dockerfiles (reused when their inputs did not change)
#   3. a sample bucket, filled through the S3 API
#   4. helm install charts/dscache
#   5. e2e/samples/datasetcache.yaml + e2e/samples/job.yaml
#   6. the story: what was staged, how fast, what training saw, that the copy was wiped
#   NODES=3: then e2e/samples/jobset.yaml under the real JobSet controller, one pod per node
#
# DSCACHE_DEMO_FILES (default 2000) sets the number of small files in the sample dataset.
# The cluster stays up afterwards (look around); `make kind-down` removes it.
set -Eeuo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
T0=$SECONDS
say()  { printf '\033[1m==> %s\033[0m\n' "$*"; }
note() { printf '    %s\n' "$*"; }

cat <<'HINT'
dscache demo. Timing hints (measured on a 2-core VM, 2026-11):
  - first run on a fresh machine: `make tools` + the kind tools build Kubernetes 1.34, etcd,
    containerd, runc, versitygw, helm, kind and the JobSet controller from source through the
    Go module proxy (cached in ~/.cache/dscache/tools), then kind's node image: see README.md.
  - later runs: ~3.5 min with the image builds; NODES=3 adds about a minute.
HINT

[ -x .venv/bin/python ] || { say "Python virtualenv (make install)"; make install; }
PY=$REPO/.venv/bin/python
NODES=${NODES:-1}

say "A 3-node kind cluster (e2e/kind/up.sh)"
# shellcheck source=kind/up.sh
source e2e/kind/up.sh          # sets KUBECONFIG, KUBECTL, HELM, S3_* , NODE_EXEC, CACHE_ROOT, images
k() { "$KUBECTL" "$@"; }

say "Filling s3://demo-datasets/imagenet-mini/ through the S3 API ($S3_ENDPOINT_HOST)"
"$PY" - "$S3_ENDPOINT_HOST" "${DSCACHE_DEMO_FILES:-2000}" <<'PYEOF'
import os, random, sys, boto3, concurrent.futures as cf
from botocore.config import Config
endpoint, n = sys.argv[1], int(sys.argv[2])
s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                  config=Config(s3={"addressing_style": "path"}, max_pool_connections=16))
try:
    s3.create_bucket(Bucket="demo-datasets")
except s3.exceptions.BucketAlreadyOwnedByYou:
    pass
rnd = random.Random(7)
objs = {f"imagenet-mini/train/n{i % 20:08d}/img_{i:05d}.jpg": rnd.randbytes(rnd.randint(8, 64) * 1024)
        for i in range(n)}
objs["imagenet-mini/val/shard-000.tar"] = rnd.randbytes(48 * 2**20)
objs["imagenet-mini/labels.txt"] = "\n".join(f"n{i:08d}" for i in range(20)).encode()
objs["imagenet-mini/scratch.tmp"] = b"excluded by the DatasetCache's exclude glob"
with cf.ThreadPoolExecutor(16) as ex:
    list(ex.map(lambda kv: s3.put_object(Bucket="demo-datasets", Key=kv[0], Body=kv[1]), objs.items()))
print(f"    {len(objs)} objects, {sum(map(len, objs.values())) / 2**20:.1f} MiB uploaded")
PYEOF

say "helm install dscache charts/dscache (cacheRoot=$CACHE_ROOT)"
t=$SECONDS
for ns in dscache-system ml; do k get namespace "$ns" >/dev/null 2>&1 || k create namespace "$ns" >/dev/null; done
# The node agents mount a hostPath on the host network: the release namespace stays at Pod Security "privileged".
k label namespace dscache-system --overwrite pod-security.kubernetes.io/enforce=privileged >/dev/null
"$HELM" upgrade --install dscache charts/dscache -n dscache-system --wait --timeout 300s \
  --set cacheRoot="$CACHE_ROOT" \
  --set image.repository="${OPERATOR_IMAGE%:*}",image.tag="${OPERATOR_IMAGE##*:}",image.pullPolicy=IfNotPresent \
  --set stager.image.repository="${STAGER_IMAGE%:*}",stager.image.tag="${STAGER_IMAGE##*:}",stager.image.pullPolicy=IfNotPresent \
  --set 'sourceCheck.secretNamespaces={ml}' ${DSCACHE_DEMO_HELM_ARGS:-} >/tmp/dscache-demo-helm.log 2>&1 || {
  cat /tmp/dscache-demo-helm.log; k get pods -n dscache-system -o wide
  for p in $(k get pods -n dscache-system -o name); do
    echo "--- $p"; k logs "$p" -n dscache-system --previous --tail=6 2>/dev/null || k logs "$p" -n dscache-system --tail=6
  done
  exit 1; }
sed -n '1,6p' /tmp/dscache-demo-helm.log | sed 's/^/    /'
note "installed in $((SECONDS - t)) s"

say "Namespace ml opts in; DatasetCache imagenet-mini (e2e/samples/datasetcache.yaml)"
k delete job train-resnet -n ml --ignore-not-found --wait=true >/dev/null
sed -e "s#http://10.251.0.1:9000#$S3_ENDPOINT_POD#" \
    -e "0,/AWS_ACCESS_KEY_ID: REPLACE_ME/s##AWS_ACCESS_KEY_ID: \"$AWS_ACCESS_KEY_ID\"#" \
    -e "0,/AWS_SECRET_ACCESS_KEY: REPLACE_ME/s##AWS_SECRET_ACCESS_KEY: \"$AWS_SECRET_ACCESS_KEY\"#" \
    e2e/samples/datasetcache.yaml | k apply -f - | sed 's/^/    /'
for _ in $(seq 120); do
  phase=$(k get dsc imagenet-mini -n ml -o jsonpath='{.status.phase}' 2>/dev/null || true)
  [ "$phase" = Ready ] || [ "$phase" = Failed ] && break; sleep 0.5
done
k get dsc -n ml | sed 's/^/    /'
[ "$phase" = Ready ] || { k describe dsc imagenet-mini -n ml; exit 1; }

say "A training Job annotated dscache.io/cache: imagenet-mini (e2e/samples/job.yaml)"
sed "s#localhost/dscache-stager:e2e#$STAGER_IMAGE#" e2e/samples/job.yaml | k apply -f - | sed 's/^/    /'
if ! k wait --for=condition=Complete job/train-resnet -n ml --timeout=300s >/dev/null; then
  k describe pods -n ml -l job-name=train-resnet; exit 1
fi
POD=$(k get pods -n ml -l job-name=train-resnet -o jsonpath='{.items[0].metadata.name}')
NODE=$(k get pod "$POD" -n ml -o jsonpath='{.spec.nodeName}')
SUMMARY=$(k get pod "$POD" -n ml -o jsonpath='{.status.initContainerStatuses[?(@.name=="dscache-stage")].state.terminated.message}')
TRAIN_LOG=$(k logs "$POD" -n ml -c train)
# The node holds the pod's revision under the cache dir; a wipe removes the revision
# (the cache dir itself stays: it is the mount source of later pods).
REV=$(k get pod "$POD" -n ml -o jsonpath='{.metadata.annotations.dscache\.io/revision}')
[ -n "$REV" ] || { echo "pod $POD carries no dscache.io/revision annotation" >&2; exit 1; }
COPY=$CACHE_ROOT/ml/imagenet-mini/revs/$REV

wiped=no
for _ in $(seq 120); do
  # On kind NODE_EXEC is "docker exec {node}": run the check on the pod's node.
  if ! ${NODE_EXEC//\{node\}/$NODE} test -e "$COPY"; then wiped=yes; break; fi; sleep 0.5
done

for _ in $(seq 60); do   # the controller records the wipe in the status (reconcile interval: 10 s)
  [ "$(k get dsc imagenet-mini -n ml -o jsonpath='{.status.nodes[0].state}')" = Wiped ] && break; sleep 0.5
done

say "What happened"
"$PY" - "$SUMMARY" "$TRAIN_LOG" "$NODE" "$COPY" "$wiped" <<'PYEOF'
import json, sys
summary, log, node, copy, wiped = sys.argv[1:6]
s = json.loads(summary.strip().splitlines()[-1])
print(f"    staged   {s['objects']} objects, {s['bytes'] / 2**20:.1f} MiB from s3://demo-datasets/imagenet-mini/")
print(f"             onto node {node}:{copy}")
print(f"    speed    {s['seconds']:.2f} s, {s['mb_s']:.0f} MB/s (the stager's own figures, from its termination message)")
print(f"    training {log.strip().splitlines()[-1] if log.strip() else '(no output)'}")
print(f"    wiped    {'yes: ' + copy + ' is gone from the node' if wiped == 'yes' else 'NO: ' + copy + ' is still there'}")
sys.exit(0 if wiped == "yes" else 1)
PYEOF
k get dsc imagenet-mini -n ml -o jsonpath='{range .status.nodes[*]}    status   kubectl get dsc: node {.node} {.state} at {.wipedAt}; it held {.objects} objects, {.bytes} bytes, copied in {.seconds} s{"\n"}{end}'
if [ "$NODES" -ge 3 ]; then
  say "Distributed: e2e/samples/jobset.yaml under the real JobSet controller, 3 workers, one per node"
  t=$SECONDS
  DSCACHE_KIND_CONTROLLERS=jobset bash e2e/kind/controllers.sh 2>&1 | grep -v '^Image:' | sed 's/^/    /'
  k delete jobset resnet-multislice -n ml --ignore-not-found --wait=true >/dev/null 2>&1 || true
  # The sample's JobSet, sized to the cluster (3 child Jobs of one pod, spread one per node),
  # running the sample Job's checking program.
  "$PY" - "$STAGER_IMAGE" <<'PYEOF' | k apply -f - | sed 's/^/    /'
import json, sys, yaml
image = sys.argv[1]
js = yaml.safe_load(open("e2e/samples/jobset.yaml"))
job = yaml.safe_load(open("e2e/samples/job.yaml"))
rj = js["spec"]["replicatedJobs"][0]
rj["replicas"] = 3
rj["template"]["spec"].update({"parallelism": 1, "completions": 1})
tpl = rj["template"]["spec"]["template"]
spec = job["spec"]["template"]["spec"]
spec["containers"][0]["image"] = image
spec["affinity"] = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
    "labelSelector": {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": js["metadata"]["name"]}},
    "topologyKey": "kubernetes.io/hostname"}]}}
tpl["spec"] = spec
print(json.dumps(js))
PYEOF
  if ! k wait --for=condition=Completed jobset/resnet-multislice -n ml --timeout=300s >/dev/null; then
    k get pods -n ml -o wide; exit 1
  fi
  for pod in $(k get pods -n ml -l jobset.sigs.k8s.io/jobset-name=resnet-multislice -o name); do
    node=$(k get "$pod" -n ml -o jsonpath='{.spec.nodeName}')
    msg=$(k get "$pod" -n ml -o jsonpath='{.status.initContainerStatuses[?(@.name=="dscache-stage")].state.terminated.message}' |
      "$PY" -c 'import json,sys; s=json.loads(sys.stdin.read().strip().splitlines()[-1]); print("staged %d objects in %.2f s" % (s["objects"], s["seconds"]))')
    gone=no
    for _ in $(seq 120); do ${NODE_EXEC//\{node\}/$node} test -e "$COPY" || { gone=yes; break; }; sleep 0.5; done
    echo "    $node: $msg; training: $(k logs "$pod" -n ml -c train | tail -n1); copy wiped: $gone"
  done
  for _ in $(seq 60); do   # the controller records the wipes (reconcile interval: 10 s)
    states=$(k get dsc imagenet-mini -n ml -o jsonpath='{.status.nodes[*].state}')
    [[ $states != *Ready* && $states != *Staging* ]] && break; sleep 0.5
  done
  k get dsc imagenet-mini -n ml -o jsonpath='{range .status.nodes[*]}    status   {.node} {.state} at {.wipedAt}{"\n"}{end}'
  note "distributed part in $((SECONDS - t)) s"
fi
note "demo done in $((SECONDS - T0)) s. Look around: kubectl describe dsc imagenet-mini -n ml (KUBECONFIG=$KUBECONFIG)"

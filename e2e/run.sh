#!/usr/bin/env bash
# make e2e: the end-to-end suite against a real single-node Kubernetes on this machine.
#
#   1. e2e/cluster/up           (idempotent: ~1 s when already up; builds missing tools first)
#   2. e2e/cluster/images.sh    the project's Dockerfiles -> buildah -> containerd
#   3. pytest e2e/              helm install (a session fixture), then the user story
#   4. build/e2e-result.json    {"passed", "failed", "overhead_s", "k8s_version", "nodes", "controllers",
#                               "tests": {name: passed|failed|skipped}, and every key of timeline.json}
#
# Environment:
#   DSCACHE_E2E_SKIP_IMAGES=1   reuse the images already in containerd (development)
#   DSCACHE_E2E_SKIP_UP=1       do not run e2e/cluster/up (e.g. the kind path, KUBECONFIG set)
#   PYTEST_ARGS                 extra pytest arguments (e.g. "-k timeline -x")
# Every other DSCACHE_E2E_* setting is documented in e2e/conftest.py.
set -Eeuo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
T0=$SECONDS
step() { printf '\n== e2e: %s (t=%ds)\n' "$*" "$((SECONDS - T0))"; }

export DSCACHE_E2E_OPERATOR_IMAGE=${DSCACHE_E2E_OPERATOR_IMAGE:-localhost/dscache-operator:e2e}
export DSCACHE_E2E_STAGER_IMAGE=${DSCACHE_E2E_STAGER_IMAGE:-localhost/dscache-stager:e2e}
export DSCACHE_E2E_RESULTS=${DSCACHE_E2E_RESULTS:-$REPO/build}
mkdir -p "$DSCACHE_E2E_RESULTS"
RESULT=$DSCACHE_E2E_RESULTS/e2e-result.json
JUNIT=$DSCACHE_E2E_RESULTS/e2e-junit.xml
rm -f "$RESULT" "$JUNIT" "$DSCACHE_E2E_RESULTS/timeline.json"

[ -x .venv/bin/python ] || { step "python venv (make install)"; make install; }
PY=$REPO/.venv/bin/python

if [ "${DSCACHE_E2E_SKIP_UP:-0}" != 1 ]; then
  step "cluster up (e2e/cluster/up)"
  t=$SECONDS; e2e/cluster/up; echo "cluster up: $((SECONDS - t)) s"
  export KUBECONFIG=${KUBECONFIG:-/var/lib/dscache-e2e/kubeconfig}
fi
export KUBECONFIG=${KUBECONFIG:-/var/lib/dscache-e2e/kubeconfig}

if [ "${DSCACHE_E2E_SKIP_IMAGES:-0}" != 1 ]; then
  step "images (e2e/cluster/images.sh): $DSCACHE_E2E_STAGER_IMAGE $DSCACHE_E2E_OPERATOR_IMAGE"
  t=$SECONDS
  DSCACHE_STAGER_IMAGE=$DSCACHE_E2E_STAGER_IMAGE DSCACHE_OPERATOR_IMAGE=$DSCACHE_E2E_OPERATOR_IMAGE \
    e2e/cluster/images.sh
  echo "images: $((SECONDS - t)) s"
fi

step "pytest e2e/"
t=$SECONDS
set +e
eval "extra=(${PYTEST_ARGS:-})"   # shell words, quotes allowed: PYTEST_ARGS="-k 'a or b'"
(cd e2e && "$PY" -m pytest -c pytest.ini --junitxml="$JUNIT" -v "${extra[@]}")
rc=$?
set -e
echo "pytest: exit $rc in $((SECONDS - t)) s"

step "result"
KUBECTL=${DSCACHE_E2E_KUBECTL:-$(bash e2e/cluster/tools.sh --path kubernetes 2>/dev/null | tail -1)/kubectl}
[ -x "$KUBECTL" ] || KUBECTL=kubectl
K8S_VERSION=$("$KUBECTL" version -o json 2>/dev/null | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["serverVersion"]["gitVersion"])' || echo unknown)
status=0
NODES=$("$KUBECTL" get nodes -o name 2>/dev/null | wc -l) || NODES=0
# The workload controllers that really run in the cluster (ready Deployments), e.g. the JobSet controller.
DEPLOYMENTS=$DSCACHE_E2E_RESULTS/deployments.json
"$KUBECTL" get deployments -A -o json >"$DEPLOYMENTS" 2>/dev/null || echo '{}' >"$DEPLOYMENTS"
"$PY" - "$JUNIT" "$DSCACHE_E2E_RESULTS/timeline.json" "$RESULT" "$K8S_VERSION" "$rc" "$NODES" "$DEPLOYMENTS" <<'PYEOF' || status=$?
import json, os, sys
import xml.etree.ElementTree as ET
junit, timeline, out, version, rc, nodes, deployments = sys.argv[1:8]
tests = failures = errors = skipped = 0
outcomes: dict[str, str] = {}
if os.path.exists(junit):
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for s in suites:
        tests += int(s.get("tests", 0)); failures += int(s.get("failures", 0))
        errors += int(s.get("errors", 0)); skipped += int(s.get("skipped", 0))
        for case in s.iter("testcase"):
            name = case.get("name", "?")
            if case.find("failure") is not None or case.find("error") is not None:
                outcomes[name] = "failed"   # an error in setup or teardown fails the test too
            elif case.find("skipped") is not None:
                outcomes.setdefault(name, "skipped")
            else:
                outcomes.setdefault(name, "passed")
passed = tests - failures - errors - skipped
# A skipped test proved nothing: it counts as failed. No tests at all is a failure too.
failed = failures + errors + skipped
if tests == 0 or (int(rc) != 0 and failed == 0):
    failed = max(failed, 1)
WORKLOAD_CONTROLLERS = ("jobset", "training-operator", "trainer")
controllers = []
try:
    for d in json.load(open(deployments)).get("items", []):
        images = [c.get("image", "") for c in d["spec"]["template"]["spec"].get("containers", [])]
        ready = (d.get("status") or {}).get("readyReplicas") or 0
        for image in images:
            base = image.rsplit("/", 1)[-1]
            if ready and any(base.startswith(k) for k in WORKLOAD_CONTROLLERS):
                controllers.append(base)
except (ValueError, KeyError):
    pass
result = {}
if os.path.exists(timeline):
    result.update(json.load(open(timeline)))   # every timeline key (overhead_s, overhead_runs, ...)
result.update({"passed": passed, "failed": failed, "overhead_s": result.get("overhead_s"),
               "k8s_version": version, "nodes": int(nodes or 0), "controllers": sorted(set(controllers)),
               "tests": outcomes})
with open(out, "w") as f:
    json.dump(result, f)
    f.write("\n")
print(json.dumps({k: v for k, v in result.items() if k != "tests"}))
print(json.dumps(outcomes, indent=1))
sys.exit(0 if failed == 0 else 1)
PYEOF

echo "e2e: $((SECONDS - T0)) s in all; $RESULT"
exit $status

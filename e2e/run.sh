#!/usr/bin/env bash
# make e2e: the end-to-end suite on a 3-node kind cluster with the real JobSet and
# Kubeflow training-operator controllers (e2e/kind/README.md).
#
#   1. e2e/kind/up.sh           dockerd, the kind cluster (3 nodes), the project's images, S3
#   2. e2e/kind/controllers.sh  JobSet and training-operator, built from source
#   3. pytest e2e/              helm install (a session fixture), the user story, the multi-node tests
#   4. build/e2e-result.json    {"passed", "failed", "overhead_s", "overhead_warm_s", "baseline_s",
#                               "overhead_over_baseline_s", "overhead_warm_over_baseline_s", "k8s_version",
#                               "nodes", "controllers", "tests": {name: passed|failed|skipped},
#                               and every key of timeline.json and timeline-warm.json}
#   5. e2e/kind/down.sh         cluster, S3 container, our dockerd, bridges and rules: gone
#
#   bash e2e/run.sh             all of it (make e2e)
#   bash e2e/run.sh up          steps 1-2 only, left up (.ci/run does this while `make test` runs;
#                               a later `bash e2e/run.sh` reuses the cluster, images and controllers)
# Environment:
#   DSCACHE_KIND_KEEP=1         leave everything up after the tests (development; `make kind-down`)
#   DSCACHE_E2E_SKIP_IMAGES=1   reuse the images already loaded in the nodes (development)
#   PYTEST_ARGS                 extra pytest arguments (e.g. "-k timeline -x")
# Every other DSCACHE_E2E_* setting is documented in e2e/conftest.py, DSCACHE_KIND_* in e2e/kind/up.sh.
set -Eeuo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
T0=$SECONDS
step() { printf '\n== e2e: %s (t=%ds)\n' "$*" "$((SECONDS - T0))"; }
MODE=${1:-all}
case $MODE in all | up) ;; *) echo "usage: e2e/run.sh [up]" >&2; exit 2 ;; esac

[ -x .venv/bin/python ] || { step "python venv (make install)"; make install; }
PY=$REPO/.venv/bin/python

if [ "$MODE" = all ] && [ "${DSCACHE_KIND_KEEP:-0}" != 1 ]; then trap 'bash e2e/kind/down.sh || true' EXIT; fi
step "cluster, images, S3 (e2e/kind/up.sh)"
# shellcheck source=kind/up.sh
source e2e/kind/up.sh
step "controllers (e2e/kind/controllers.sh)"
t=$SECONDS; bash e2e/kind/controllers.sh; echo "controllers: $((SECONDS - t)) s"
echo "cluster, images, S3 and controllers ready after $((SECONDS - T0)) s"
[ "$MODE" = up ] && exit 0

export DSCACHE_E2E_MULTINODE=1 DSCACHE_E2E_KUBECTL=$KUBECTL DSCACHE_E2E_HELM=$HELM
export DSCACHE_E2E_STAGER_IMAGE=$STAGER_IMAGE DSCACHE_E2E_OPERATOR_IMAGE=$OPERATOR_IMAGE
export DSCACHE_E2E_PULL_POLICY=Never DSCACHE_E2E_CACHE_ROOT=$CACHE_ROOT
export DSCACHE_E2E_S3_ENDPOINT_POD=$S3_ENDPOINT_POD DSCACHE_E2E_NODE_EXEC=$NODE_EXEC
export DSCACHE_E2E_REJOIN_CMD=$KIND_REJOIN_CMD
export DSCACHE_E2E_RESULTS=${DSCACHE_E2E_RESULTS:-$REPO/build}
mkdir -p "$DSCACHE_E2E_RESULTS"
RESULT=$DSCACHE_E2E_RESULTS/e2e-result.json
JUNIT=$DSCACHE_E2E_RESULTS/e2e-junit.xml
rm -f "$RESULT" "$JUNIT" "$DSCACHE_E2E_RESULTS/timeline.json" "$DSCACHE_E2E_RESULTS/timeline-warm.json"

step "pytest e2e/"
t=$SECONDS
set +e
eval "extra=(${PYTEST_ARGS:-})"   # shell words, quotes allowed: PYTEST_ARGS="-k 'a or b'"
(cd e2e && "$PY" -m pytest -c pytest.ini --junitxml="$JUNIT" -v --durations=15 "${extra[@]}")
rc=$?
set -e
echo "pytest: exit $rc in $((SECONDS - t)) s"

step "result"
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
warm = os.path.join(os.path.dirname(timeline), "timeline-warm.json")
if os.path.exists(warm):
    result.update(json.load(open(warm)))       # overhead_warm_s, overhead_warm_runs, ... (test_prestage_then_place)
# What dscache itself costs: each overhead over what the same Job without dscache paid on the
# same node in this run (test_09's baseline; the warm runs' node's own when it was measured there).
baseline = result.get("baseline_s")
warm_nodes = {r.get("node") for r in result.get("warm_runs") or []}
warm_baseline = baseline
if len(warm_nodes) == 1:
    warm_baseline = (result.get("baseline_by_node") or {}).get(warm_nodes.pop(), baseline)
def over(value, base):
    return None if value is None or base is None else round(value - base, 3)
result.update({"overhead_over_baseline_s": over(result.get("overhead_s"), baseline),
               "overhead_warm_baseline_s": warm_baseline,
               "overhead_warm_over_baseline_s": over(result.get("overhead_warm_s"), warm_baseline)})
result.update({"passed": passed, "failed": failed, "overhead_s": result.get("overhead_s"),
               "overhead_warm_s": result.get("overhead_warm_s"), "baseline_s": baseline,
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

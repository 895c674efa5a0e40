"""10. Timeline of an annotated Job, and the overhead dscache adds beyond the copy itself.

overhead_s = (training container start - Job create) - the stager's own copy seconds.

- Job create: the later of the client clock just before `kubectl create` and the
  API server's creationTimestamp (whole seconds, rounded down). Both are at or
  before the real moment, so the overhead is never under-reported.
- Init container start/end: the kubelet's startedAt/finishedAt (whole seconds).
- Copy seconds: the stager's own figure, from its termination message.
- Training start: the first line the training program prints (time.time(), the
  node's clock; kind nodes are containers sharing this machine's clock).

Three cold runs, each on a fresh cache; overhead_s is their median and
overhead_runs lists every run's figure. Both are written to
$DSCACHE_E2E_RESULTS/timeline.json, which e2e/run.sh copies into
build/e2e-result.json, with the product's target (target_s) and whether the
median met it.

baseline_s: what the same Job pays without dscache. The same Job (same
namespace, image, pod spec and program) without the dscache.io/cache
annotation, pinned to the node the cold runs used, timed the same way (Job
create to the program's first line), three times in this run; baseline_s is
their median. It is also measured on the node test_30 pre-stages on (the last
schedulable node), when that is another, for the warm figure
(baseline_by_node). e2e/run.sh reports overhead_s and overhead_warm_s also as
their difference from it (overhead_over_baseline_s,
overhead_warm_over_baseline_s): what dscache itself costs beyond what the
kubelet costs any Job on that node. The figure is reported, not asserted: speed is judged from
measurements, never by a timed test on a shared 2-core machine. The test
fails when the timeline is not a real one: a copy that was not timed, or
events out of order.
"""

import json
import statistics

from conftest import assert_complete, init_summary, job_pods
from support import workloads as w
from support.kube import schedulable_nodes
from support.timeline import measure, measure_baseline

TARGET_S = 1.0  # the product's target for Job create to training start, minus the copy
RUNS = 3  # odd, so the median is one real run


def test_timeline_overhead(cfg, kube, cache_factory, dataset):
    """overhead_s is the MEDIAN of RUNS cold runs, each on a fresh cache; every run's
    figure is in overhead_runs (e2e/run.sh copies both into build/e2e-result.json)."""
    runs = []
    for i in range(1, RUNS + 1):
        cache = cache_factory("timeline")
        job = w.training_job(f"timeline-{i}", cache["namespace"], cache["name"], cfg.stager_image, dataset)
        runs.append(measure(kube, job, assert_complete, job_pods, init_summary))
    for r in runs:
        assert r["copied_bytes"] == dataset.bytes, r  # a real copy was timed, not a reuse
        # Whole-second kubelet stamps can tie, never run backwards.
        order = ["init_start_after_s", "init_end_after_s", "training_container_started_at_after_s"]
        assert [r[k] for k in order] == sorted(r[k] for k in order), r
    overheads = [r["overhead_s"] for r in runs]
    median = round(statistics.median(overheads), 3)
    # The baseline: the same Job without dscache, on the node the cold runs used (and on the
    # node test_30 pre-stages on, for the warm figure), three times each, in this run.
    ns = cache["namespace"]
    cold_node = statistics.mode(r["node"] for r in runs)
    nodes = list(dict.fromkeys([cold_node, schedulable_nodes(kube)[-1]]))
    baseline_runs = []
    for node in nodes:
        for i in range(1, RUNS + 1):
            # The same Job as above (namespace, image, pod spec, program), without the annotation.
            job = w.training_job(f"baseline-{nodes.index(node)}-{i}", ns, None, cfg.stager_image, dataset)
            baseline_runs.append(measure_baseline(kube, job, node, job_pods))
            kube.delete("job", job["metadata"]["name"], ns, extra=["--cascade=background"])
    by_node = {
        node: round(statistics.median(r["training_start_after_s"] for r in baseline_runs if r["node"] == node), 3)
        for node in nodes
    }
    result = {
        "overhead_s": median,
        "overhead_runs": overheads,
        "overhead_statistic": "median",
        "target_s": TARGET_S,
        "target_met": median <= TARGET_S,
        "baseline_s": by_node[cold_node],
        "baseline_node": cold_node,
        "baseline_runs": [r["training_start_after_s"] for r in baseline_runs if r["node"] == cold_node],
        "baseline_by_node": by_node,
        "baseline_statistic": "median",
        "runs": runs,
        "baseline_timelines": baseline_runs,
    }
    cfg.results.mkdir(parents=True, exist_ok=True)
    (cfg.results / "timeline.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))

"""11. The operator's /metrics on a real cluster (issue 10): a staged Job moves the staging series.

Self-contained: its own DatasetCache and Job. The controller's endpoint is read
through the API server's pod proxy (what `kubectl get --raw` does), so no
port-forward is needed. The scrape is saved as <results>/metrics-scrape.txt.
"""

from __future__ import annotations

import re
import tomllib

from conftest import (
    RELEASE_NS,
    REPO,
    assert_complete,
    cache_status,
    describe_pods,
    init_summary,
    job_pods,
    leader_pod,
)
from support import workloads as w
from support.kube import wait_for

METRICS_PORT = 9090  # the chart's metrics.port


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample's value in Prometheus text format (None: no such series)."""
    want = {k: str(v) for k, v in labels.items()}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if got == want:
            return float(m.group(3))
    return None


def scrape_controller(kube) -> str:
    pod = leader_pod(kube)  # the standby reconciles nothing: its per-cache series stay empty
    path = f"/api/v1/namespaces/{RELEASE_NS}/pods/{pod['metadata']['name']}:{METRICS_PORT}/proxy/metrics"
    return kube.kubectl("get", "--raw", path).stdout


def test_metrics_after_a_staged_job(cfg, kube, cache_factory, dataset):
    cache = cache_factory("metrics")
    ns, name = cache["namespace"], cache["name"]
    labels = {"namespace": ns, "cache": name}

    def scrape_when(ok) -> str | None:
        text = scrape_controller(kube)
        return text if ok(text) else None

    # The cache's series exist, at zero, once the controller has reconciled it.
    before = wait_for(
        "the cache's staging series at zero",
        lambda: scrape_when(lambda t: sample(t, "dscache_staged_bytes_total", **labels) == 0),
        timeout=60,
    )
    assert sample(before, "dscache_stager_runs_total", result="ok", **labels) == 0
    assert sample(before, "dscache_stage_seconds_count", **labels) == 0
    assert sample(before, "dscache_wipes_total", result="succeeded", **labels) == 0

    job = "train-metrics"
    kube.create(w.training_job(job, ns, name, cfg.stager_image, dataset))
    assert_complete(kube, ns, job)
    (pod,) = job_pods(kube, ns, job)
    summary = init_summary(pod)

    text = wait_for(
        "dscache_stage_seconds_count of the cache at 1",
        lambda: scrape_when(lambda t: sample(t, "dscache_stage_seconds_count", **labels) == 1),
        timeout=60,
        describe=lambda: describe_pods(kube, ns) + "\n" + str(cache_status(kube, ns, name)),
    )
    assert sample(text, "dscache_stager_runs_total", result="ok", **labels) == 1
    assert sample(text, "dscache_stager_runs_total", result="failed", **labels) == 0
    assert sample(text, "dscache_staged_bytes_total", **labels) == summary["fetched_bytes"] == dataset.bytes
    assert sample(text, "dscache_reused_bytes_total", **labels) == 0  # a cold copy reuses nothing
    assert abs(sample(text, "dscache_stage_seconds_sum", **labels) - summary["seconds"]) < 0.01
    assert sample(text, "dscache_datasetcaches", phase="Ready") >= 1
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert re.search(rf'^dscache_build_info{{[^}}]*version="{re.escape(version)}"[^}}]*}} 1\.0$', text, re.M), (
        f"no dscache_build_info with version {version}"
    )
    assert sample(text, "process_resident_memory_bytes") > 0

    # The Job completed: its copy is wiped, and the wipe is counted for this cache.
    text = wait_for(
        "a succeeded wipe counted for the cache",
        lambda: scrape_when(lambda t: (sample(t, "dscache_wipes_total", result="succeeded", **labels) or 0) >= 1),
        timeout=120,
    )
    # Every later reconciliation still sees the finished pod; the run is counted once.
    assert sample(text, "dscache_stager_runs_total", result="ok", **labels) == 1
    cfg.results.mkdir(parents=True, exist_ok=True)
    (cfg.results / "metrics-scrape.txt").write_text(text)

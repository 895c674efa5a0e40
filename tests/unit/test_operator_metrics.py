"""The operator's Prometheus metrics: prometheus_client on a registry of their own."""

from __future__ import annotations

import datetime
import json

from prometheus_client.parser import text_string_to_metric_families

from dscache_contract import RevisionRef, StageSummary
from dscache_operator.cluster.workloads import PodInfo, pod_info
from dscache_operator.metrics.registry import Metrics
from dscache_operator.version import package_version

START = datetime.datetime(2026, 11, 22, 12, 0, 0, tzinfo=datetime.UTC)
REV = RevisionRef("r-" + "1" * 20)
SUMMARY = {"objects": 3, "bytes": 1000, "fetched_bytes": 600, "seconds": 4.2, "warm": False}


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def pod(uid: str, init: str, finished: str, started: str = "2026-11-22T12:00:01Z", summary=SUMMARY) -> PodInfo:
    ok = init == "ok"
    return PodInfo(
        "p-" + uid,
        "n1",
        "Running",
        None,
        "HostPath",
        init,
        started,
        None if ok else "error: access denied",
        uid,
        REV,
        init_finished=finished,
        summary=StageSummary.from_message(json.dumps(summary)) if ok else None,
    )


def test_build_info_process_and_zero_series():
    m = Metrics(version="9.9.9")
    assert value(m, "dscache_build_info", version="9.9.9", python=__import__("platform").python_version()) == 1
    text = m.render().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "python_info"} <= names
    # Before any cache exists, the gauges and the admission counters are already there, at zero.
    assert value(m, "dscache_datasetcaches", phase="Ready") == 0
    assert value(m, "dscache_node_copies", state="Wiped") == 0
    assert value(m, "dscache_admission_reviews_total", mode="HostPath", result="refused") == 0
    assert value(m, "dscache_source_checks_total", reason="NoSuchBucket") == 0
    assert value(m, "dscache_admission_seconds_count") == 0
    # The first reconciliation of a cache creates its series at zero; deletion removes them.
    assert value(m, "dscache_wipes_total", namespace="ml", cache="a", result="failed") is None
    m.set_cache("ml", "a", "Ready", ["Ready", "Wiped"])
    assert value(m, "dscache_wipes_total", namespace="ml", cache="a", result="failed") == 0
    assert value(m, "dscache_stager_runs_total", namespace="ml", cache="a", result="failed") == 0
    assert value(m, "dscache_staged_bytes_total", namespace="ml", cache="a") == 0
    assert value(m, "dscache_stage_seconds_count", namespace="ml", cache="a") == 0
    m.set_cache("ml", "b", "Failed", [])
    assert value(m, "dscache_datasetcaches", phase="Ready") == 1
    assert value(m, "dscache_datasetcaches", phase="Failed") == 1
    assert value(m, "dscache_node_copies", state="Wiped") == 1
    m.forget_cache("ml", "a")
    assert value(m, "dscache_datasetcaches", phase="Ready") == 0
    assert value(m, "dscache_wipes_total", namespace="ml", cache="a", result="failed") is None
    assert value(m, "dscache_staged_bytes_total", namespace="ml", cache="a") is None


def test_registries_are_isolated():
    a, b = Metrics(), Metrics()
    a.source_checked("NoSuchBucket")
    assert value(a, "dscache_source_checks_total", reason="NoSuchBucket") == 1
    assert value(b, "dscache_source_checks_total", reason="NoSuchBucket") == 0


def test_admission_histogram():
    m = Metrics()
    m.admission("HostPath", "admitted", 0.003)
    assert value(m, "dscache_admission_reviews_total", mode="HostPath", result="admitted") == 1
    assert value(m, "dscache_admission_seconds_bucket", le="0.0025") == 0
    assert value(m, "dscache_admission_seconds_bucket", le="0.005") == 1
    assert value(m, "dscache_admission_seconds_count") == 1


def test_each_stager_run_is_counted_once():
    m = Metrics(since=START)
    m.set_cache("ml", "c", "Ready", [])
    ok = pod("u1", "ok", "2026-11-22T12:00:05Z")
    warm = pod("u2", "ok", "2026-11-22T12:00:06Z", summary={"bytes": 1000, "fetched_bytes": 0, "seconds": 0.1})
    failed = pod("u3", "failed", "2026-11-22T12:00:07Z")
    running = pod("u4", "running", "")
    assert m.observe_stagers("ml", "c", [ok, warm, failed, running]) == 3
    # Every reconciliation sees the same finished pods again: nothing moves.
    assert m.observe_stagers("ml", "c", [ok, warm, failed, running]) == 0
    labels = {"namespace": "ml", "cache": "c"}
    assert value(m, "dscache_stager_runs_total", result="ok", **labels) == 2
    assert value(m, "dscache_stager_runs_total", result="failed", **labels) == 1
    assert value(m, "dscache_staged_bytes_total", **labels) == 600
    assert value(m, "dscache_reused_bytes_total", **labels) == 400 + 1000
    assert value(m, "dscache_stage_seconds_count", **labels) == 2
    assert abs(value(m, "dscache_stage_seconds_sum", **labels) - 4.3) < 1e-9
    assert value(m, "dscache_stage_seconds_bucket", le="0.5", **labels) == 1
    # The failed pod's stager restarts (restartPolicy OnFailure) and fails again: a new run.
    again = pod("u3", "failed", "2026-11-22T12:01:00Z", started="2026-11-22T12:00:50Z")
    assert m.observe_stagers("ml", "c", [ok, warm, again]) == 1
    assert value(m, "dscache_stager_runs_total", result="failed", **labels) == 2


def test_a_restarted_operator_does_not_count_runs_that_finished_before_it_started():
    """The previous process counted (and Prometheus scraped) those; a restart re-sees them."""
    before = pod("u1", "ok", "2026-11-22T11:59:59Z")
    after = pod("u2", "ok", "2026-11-22T12:00:02Z")
    m = Metrics(since=START)
    assert m.observe_stagers("ml", "c", [before, after]) == 1
    assert value(m, "dscache_staged_bytes_total", namespace="ml", cache="c") == 600
    assert value(m, "dscache_stager_runs_total", namespace="ml", cache="c", result="ok") == 1


def test_pod_info_reads_the_init_containers_finish_time():
    body = {
        "metadata": {"name": "p", "uid": "u1"},
        "status": {
            "phase": "Running",
            "initContainerStatuses": [
                {
                    "name": "dscache-stage",
                    "state": {
                        "terminated": {
                            "exitCode": 0,
                            "message": json.dumps(SUMMARY),
                            "startedAt": "2026-11-22T12:00:01Z",
                            "finishedAt": "2026-11-22T12:00:05Z",
                        }
                    },
                }
            ],
        },
    }
    info = pod_info(body)
    assert (info.init, info.init_finished) == ("ok", "2026-11-22T12:00:05Z")
    m = Metrics(since=START)
    assert m.observe_stagers("ml", "c", [info]) == 1


def test_package_version_is_the_installed_one():
    assert package_version() not in ("", "unknown")


def test_each_process_exports_its_own_families():
    names = {role: {f.name for f in Metrics(role=role).registry.collect()} for role in ("controller", "webhook")}
    assert "dscache_datasetcaches" in names["controller"] and "dscache_datasetcaches" not in names["webhook"]
    assert "dscache_admission_reviews" in names["webhook"] and "dscache_admission_reviews" not in names["controller"]
    assert {"dscache_build_info", "process_cpu_seconds"} <= names["controller"] & names["webhook"]
    # The other role's calls are harmless no-ops for the scrape.
    hook = Metrics(role="webhook")
    hook.set_cache("ml", "c", "Ready", [])
    assert hook.registry.get_sample_value("dscache_datasetcaches", {"phase": "Ready"}) is None

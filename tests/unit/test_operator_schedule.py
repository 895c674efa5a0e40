"""The controller's scheduler and its compact view of a DatasetCache (pure asyncio, no API server)."""

from __future__ import annotations

import asyncio
import json

from dscache_contract import StageSummary
from dscache_operator.cluster.caches import cache_view, wants_reconcile
from dscache_operator.kube.schedule import Scheduler
from dscache_operator.metrics.cacheseries import CacheSeries

SPEC = {"source": {"uri": "s3://bkt/p/", "credentials": {"secretRef": {"name": "k"}}}, "mountPath": "/data"}


def body(name: str, **meta) -> dict:
    return {
        "metadata": {"namespace": "ml", "name": name, "uid": f"u-{name}", "generation": 1, **meta},
        "spec": json.loads(json.dumps(SPEC)),
        "status": {"phase": "Ready", "nodes": [{"node": "n1", "state": "Ready"}]},
    }


def run(scheduler: Scheduler, until, timeout: float = 5.0) -> None:
    async def go() -> None:
        task = asyncio.create_task(scheduler.run())
        try:
            async with asyncio.timeout(timeout):
                while not until():
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await scheduler.stop()

    asyncio.run(go())


def test_a_failed_run_is_due_again_and_every_key_converges():
    """Issue 19: a kopf timer whose status write failed once never ran again. Here every
    key whose first runs fail is retried (after a backoff) until it succeeds."""
    done: set[int] = set()
    attempts: dict[int, int] = {}

    async def reconcile(key) -> float | None:
        attempts[key] = attempts.get(key, 0) + 1
        if key % 4 == 0 and attempts[key] < 3:
            raise RuntimeError("HTTP 422: status write refused")
        done.add(key)
        return None  # converged: forget it

    s = Scheduler(reconcile, workers=3, max_backoff=0.05)
    for key in range(40):
        s.touch(key)
    run(s, lambda: len(done) == 40, timeout=20)
    assert done == set(range(40)) and all(attempts[k] == 3 for k in range(0, 40, 4))


def test_longest_waiting_first_and_never_twice_at_once():
    order: list[int] = []
    running: set[int] = set()
    overlap: list[int] = []

    async def reconcile(key) -> float | None:
        if key in running:
            overlap.append(key)
        running.add(key)
        await asyncio.sleep(0.001)
        running.discard(key)
        order.append(key)
        return 0.0 if len(order) < 30 else None

    s = Scheduler(reconcile, workers=1)
    for key in (1, 2, 3):
        s.touch(key)
    run(s, lambda: len(order) >= 30)
    # Round robin: each key waits behind the others, none is starved.
    assert order[:9] == [1, 2, 3] * 3 and not overlap


def test_a_touch_while_running_runs_it_again_at_once():
    runs: list[float] = []

    async def reconcile(key) -> float | None:
        runs.append(asyncio.get_running_loop().time())
        if len(runs) == 1:
            s.touch(key)  # a change seen while it is being reconciled
        return 60.0 if len(runs) < 2 else None

    s = Scheduler(reconcile, workers=2)
    s.touch("a")
    run(s, lambda: len(runs) >= 2)
    assert runs[1] - runs[0] < 1.0  # not after the 60 s interval


def test_equal_specs_are_one_object_and_status_is_kept_as_text():
    a, b = cache_view(body("a")), cache_view(body("b"))
    assert a.spec is b.spec and a.spec is not None and a.spec.source.secret_name == "k"
    assert isinstance(a.status_json, str) and a.status()["nodes"][0]["state"] == "Ready"
    assert a.status() is not a.status()  # the caller may change what it gets
    assert not a.finalized and not a.deleting


def test_only_news_makes_a_cache_due_now():
    old = cache_view(body("a"))
    status_only = body("a")
    status_only["status"]["phase"] = "Failed"  # our own status write coming back
    assert not wants_reconcile(old, cache_view(status_only))
    assert not wants_reconcile(old, cache_view(body("a", finalizers=["dscache.io/wipe"])))  # ours, added
    assert wants_reconcile(old, cache_view(body("a", generation=2)))
    assert wants_reconcile(old, cache_view(body("a", annotations={"dscache.io/refresh": "now"})))
    assert wants_reconcile(old, cache_view(body("a", deletionTimestamp="2026-01-01T00:00:00Z")))
    assert wants_reconcile(old, None) and wants_reconcile(None, old)


def test_per_cache_series_from_one_array():
    c = CacheSeries()
    c.set(("ml", "a"), "Ready", ["Ready", "Staging"])
    c.wipe(("ml", "a"), "kept")
    c.stager_run(("ml", "a"), "ok")
    c.staged(("ml", "a"), 0.7, staged=20, reused=10, bucket=5, peer=15)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in c.collect() for s in f.samples}

    def sample(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    mine = {"namespace": "ml", "cache": "a"}
    assert sample("dscache_wipes_total", result="kept", **mine) == 1
    assert sample("dscache_wipes_total", result="failed", **mine) == 0
    assert sample("dscache_peer_bytes_total", **mine) == 15
    assert sample("dscache_bucket_bytes_total", **mine) == 5
    assert sample("dscache_stage_seconds_bucket", le="0.5", **mine) == 0
    assert sample("dscache_stage_seconds_bucket", le="1.0", **mine) == 1
    assert sample("dscache_stage_seconds_bucket", le="+Inf", **mine) == 1
    assert sample("dscache_node_copies", state="Staging") == 1
    c.forget(("ml", "a"))
    assert not any(s.labels.get("cache") == "a" for f in c.collect() for s in f.samples)


def test_the_stage_summary_is_parsed_once_typed():
    line = json.dumps(
        {"objects": 2, "bytes": 30, "fetched_bytes": 20, "seconds": 1, "bucket_bytes": 5, "peer_bytes": 15}
    )
    s = StageSummary.from_message("progress ...\n" + line + "\n")
    assert s is not None and (s.bytes, s.seconds, s.bucket_bytes, s.peer_bytes) == (30, 1, 5, 15)
    old = StageSummary.from_message(json.dumps({"objects": 2, "bytes": 30}))  # a stager before peers
    assert old is not None and (old.bucket_bytes, old.peer_bytes) == (0, 0)
    wrong = StageSummary.from_message(json.dumps({"bytes": "30", "peer_bytes": True, "seconds": -1, "new": 1}))
    assert wrong is not None and (wrong.bytes, wrong.peer_bytes, wrong.seconds) == (0, 0, 0.0)
    assert StageSummary.from_message("error: access denied") is None
    assert StageSummary.from_message('{"bytes": 3') is None and StageSummary.from_message(None) is None


def test_a_burst_of_source_checks_reads_each_secret_once():
    from dscache_operator.control.sourcecheck import SecretReads

    class Kube:
        calls = 0

        async def get_secret(self, namespace: str, name: str):
            Kube.calls += 1
            return {"data": {}} if name == "there" else None

    reads, kube = SecretReads(ttl=60.0, most=2), Kube()

    async def burst() -> list:
        return [await reads.get(kube, "ml", name) for name in ["there"] * 5 + ["gone"] * 3 + ["third", "third"]]  # type: ignore[arg-type]

    got = asyncio.run(burst())
    assert got[:5] == [{"data": {}}] * 5 and got[5:8] == [None] * 3
    assert Kube.calls == 4  # there, gone, and third twice: beyond `most` entries nothing more is kept

"""A steady cache's periodic reconciliation is skipped while nothing it reads has changed
(quiet.py), and runs again as soon as anything does (views filled by hand, a stub API client)."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import pytest

from dscache_contract import clock
from dscache_operator.api.models import NodeRevision, NodeStatus, Retention
from dscache_operator.cluster.views import Views
from dscache_operator.control import reconcile as controller
from dscache_operator.control.nodeplan import KEEP_WIPED_S, KEPT_RETRY_S, changes_by_time_at
from dscache_operator.control.state import ControlContext
from dscache_operator.kube.events import Poster
from dscache_operator.settings import Settings

NS, KEY = "ml", ("ml", "ds")
NOW = datetime.datetime(2026, 11, 21, 12, 0, 0, tzinfo=datetime.UTC)
REV = "r-0123456789abcdef0123"


class Kube:
    """Records the writes; the controller reads nothing else from it here."""

    def __init__(self) -> None:
        self.writes: list[Any] = []

    async def patch_status(self, path: str, status: dict[str, Any]) -> None:
        self.writes.append(status)

    async def add_finalizer(self, *args: Any) -> None:
        self.writes.append(args)

    async def get(self, path: str) -> dict[str, Any]:
        return {}


def cache(status: dict[str, Any]) -> dict[str, Any]:
    """The cache as a watch event brings it (each event: a new view)."""
    meta = {"namespace": NS, "name": "ds", "uid": "u-ds", "generation": 1, "finalizers": ["dscache.io/wipe"]}
    spec = {"source": {"uri": "s3://bkt/data/"}, "mountPath": "/data"}
    return {"metadata": meta, "spec": spec, "status": status}


def pod(i: int, phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": NS,
            "name": f"train-{i}",
            "uid": f"p{i}",
            "labels": {"dscache.io/consumer": "true"},
            "annotations": {"dscache.io/cache": "ds", "dscache.io/volume": "HostPath"},
        },
        "spec": {"nodeName": f"n{i}"},
        "status": {"phase": phase},
    }


@pytest.fixture
def steady(monkeypatch):
    """A checked cache with two consumer pods, reconciled until its status is written: the
    context, the views, and the number of (full) reconciliations so far."""
    ctx = ControlContext(settings=Settings(peers=False), kube=Kube())  # type: ignore[arg-type]
    ctx.poster = Poster(ctx.kube)  # type: ignore[arg-type]
    views = ctx.views = Views(ctx.kube, (NS,))  # type: ignore[arg-type]
    for m in views._all():
        for informer in m.informers.values():
            informer.ready.set()
    for i in range(2):
        views.pods.informers[NS]._upsert(pod(i))
    listed = clock.fmt_time(clock.now())
    status = {
        "phase": "Ready",
        "observedGeneration": 1,
        "revision": {"id": REV, "objects": 1, "bytes": 1, "listedAt": listed, "versioned": False},
        "conditions": [
            {"type": "SourceReady", "status": "True", "reason": "Listed", "message": "x", "lastTransitionTime": listed}
        ],
    }
    runs = []
    real = controller.reconcile

    async def counted(*args: Any) -> Any:
        runs.append(1)
        return await real(*args)

    monkeypatch.setattr(controller, "reconcile", counted)
    views.caches.informers[NS]._upsert(cache(status))
    for _ in range(3):
        again(ctx)
    assert KEY in ctx.quiet
    return ctx, views, runs


def again(ctx: ControlContext) -> None:
    """One due run; what it writes comes back from the watch as a new view of the cache."""
    asyncio.run(controller.run_once(ctx, KEY))
    written = [w for w in ctx.kube.writes if isinstance(w, dict)]  # type: ignore[attr-defined]
    ctx.kube.writes.clear()  # type: ignore[attr-defined]
    if written:
        status = ctx.views.cache(KEY).status()
        for w in written:
            status.update({k: v for k, v in w.items() if v is not None})
        ctx.views.caches.informers[NS]._upsert(cache(status))


def test_a_steady_cache_is_not_reconciled_again_until_something_changes(steady):
    """Issue 19: 10,000 steady caches were each planned again every 10 s (most of a core)."""
    ctx, views, runs = steady
    n = len(runs)
    for _ in range(5):
        asyncio.run(controller.run_once(ctx, KEY))
    assert len(runs) == n and ctx.kube.writes == []
    views.pods.informers[NS]._upsert(pod(0, phase="Succeeded"))  # a consumer ended
    again(ctx)
    assert len(runs) == n + 1


def test_a_new_consumer_pod_or_a_changed_node_makes_it_run(steady):
    ctx, views, runs = steady
    n = len(runs)
    views.pods.informers[NS]._upsert(pod(7))
    again(ctx)  # it writes the new node's entry
    assert len(runs) == n + 1
    again(ctx)  # and sees it written
    again(ctx)
    assert len(runs) == n + 2
    node = {"metadata": {"name": "n1", "uid": "node-n1", "labels": {}}, "status": {}}
    views.nodes.informers[None]._upsert(node)
    m = len(runs)
    again(ctx)
    assert len(runs) == m + 1
    again(ctx)
    assert len(runs) == m + 1  # quiet again
    views.nodes.informers[None]._upsert(node | {"status": {"conditions": []}})  # a heartbeat: nothing we keep
    again(ctx)
    assert len(runs) == m + 1
    views.nodes.informers[None]._upsert(node | {"metadata": {**node["metadata"], "labels": {"zone": "a"}}})
    again(ctx)
    assert len(runs) == m + 2


def test_time_runs_it_again(steady, monkeypatch):
    ctx, _views, runs = steady
    n = len(runs)
    later = datetime.datetime.fromtimestamp(ctx.quiet[KEY].until + 1, datetime.UTC)
    monkeypatch.setattr(controller.clock, "now", lambda: later)
    again(ctx)
    assert len(runs) == n + 1


def test_when_time_alone_changes_a_plan():
    ttl = Retention(policy="RetainWhileUsed", ttlAfterLastUse="1h")
    used = "2026-11-21T11:30:00Z"
    held = NodeStatus(node="n1", state="Ready", consumers=1, revisions=[NodeRevision(id=REV, consumers=1)])
    assert changes_by_time_at([held], ttl, NOW) is None
    unused = NodeStatus(node="n1", state="Ready", revisions=[NodeRevision(id=REV, lastUsed=used)])
    assert changes_by_time_at([unused], ttl, NOW) == NOW + datetime.timedelta(minutes=30)
    assert changes_by_time_at([unused], Retention(), NOW) == NOW - datetime.timedelta(minutes=30)
    kept = NodeRevision(id=REV, consumers=1, keptAt="2026-11-21T11:59:00Z")
    at = changes_by_time_at([NodeStatus(node="n1", state="Ready", consumers=1, revisions=[kept])], ttl, NOW)
    assert at == NOW + datetime.timedelta(seconds=KEPT_RETRY_S - 60)
    wiped = NodeStatus(node="n1", state="Wiped", wipedAt="2026-11-21T11:00:00Z")
    assert changes_by_time_at([wiped], ttl, NOW) == NOW + datetime.timedelta(seconds=KEEP_WIPED_S - 3600)
    unreadable = NodeStatus(node="n1", state="Ready", revisions=[NodeRevision(id=REV)])  # no lastUsed
    assert changes_by_time_at([unreadable], ttl, NOW) == NOW


def test_a_wipe_that_cannot_be_sent_yet_is_planned_again_every_time(steady):
    """Its node has no agent: the wipe waits (no new Event, no new status after the first
    time), and is planned again at each run, not skipped as if nothing were to be done."""
    ctx, views, runs = steady
    for i in range(2):
        views.pods.informers[NS]._upsert(pod(i, phase="Succeeded"))  # no owner: done, so wiped
    for _ in range(3):
        again(ctx)
    n = len(runs)
    again(ctx)
    again(ctx)
    assert len(runs) == n + 2 and KEY not in ctx.quiet

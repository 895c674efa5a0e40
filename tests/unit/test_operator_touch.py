"""What makes a cache due: its users' changes at once, and never a run on a view that does not
show the controller's own last status write (views filled by hand, no API server)."""

from __future__ import annotations

from typing import Any

import pytest

from dscache_operator.cluster.caches import cache_view
from dscache_operator.cluster.views import Views
from dscache_operator.control import state
from dscache_operator.control.state import ControlContext
from dscache_operator.settings import Settings

NS, KEY = "ml", ("ml", "ds")


class Scheduler:
    def __init__(self) -> None:
        self.touched: list[Any] = []

    def touch(self, key: Any, delay: float = 0.0) -> None:
        self.touched.append(key)


def cache_body(rv: str) -> dict[str, Any]:
    meta = {"namespace": NS, "name": "ds", "uid": "u", "generation": 1, "resourceVersion": rv}
    return {"metadata": meta, "spec": {"source": {"uri": "s3://b/p/"}, "mountPath": "/data"}, "status": {}}


def pod(phase: str, node: str | None = "n1") -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": NS,
            "name": "train-0",
            "uid": "p0",
            "labels": {"dscache.io/consumer": "true"},
            "annotations": {"dscache.io/cache": "ds", "dscache.io/volume": "CSI"},
            "ownerReferences": [{"kind": "Job", "name": "train", "uid": "j0", "controller": True}],
        },
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase},
    }


def job(done: bool) -> dict[str, Any]:
    conds = [{"type": "Complete", "status": "True"}] if done else []
    return {"metadata": {"namespace": NS, "name": "train", "uid": "j0"}, "status": {"conditions": conds}}


@pytest.fixture
def ctx() -> ControlContext:
    c = ControlContext(settings=Settings(peers=False), kube=object())  # type: ignore[arg-type]
    c.scheduler = Scheduler()  # type: ignore[assignment]
    return c


def test_a_pods_changes_make_its_cache_due(ctx):
    views = Views(object(), (NS,), touch=ctx.touch)  # type: ignore[arg-type]
    pods = views.pods.informers[NS]
    pods._upsert(pod("Pending", node=None))
    pods._upsert(pod("Pending", node=None))  # the same as seen: no news
    pods._upsert(pod("Running"))
    pods._remove("p0")
    assert ctx.scheduler.touched == [KEY, KEY, KEY]  # type: ignore[union-attr]


def test_a_workload_finishing_makes_its_pods_caches_due(ctx):
    views = Views(object(), (NS,), touch=ctx.touch)  # type: ignore[arg-type]
    views.pods.informers[NS]._upsert(pod("Succeeded"))
    jobs = views.jobs.informers[NS]
    jobs._upsert(job(False))
    ctx.scheduler.touched.clear()  # type: ignore[union-attr]
    jobs._upsert(job(False))  # a status change that finishes nothing
    assert ctx.scheduler.touched == []  # type: ignore[union-attr]
    jobs._upsert(job(True))
    assert ctx.scheduler.touched == [KEY]  # type: ignore[union-attr]


def test_no_run_on_a_view_that_does_not_show_our_write(ctx, monkeypatch):
    # Our write coming back is no news by itself (nothing waited for it).
    ctx.wrote(KEY, "9")
    ctx.on_cache(KEY, cache_view(cache_body("8")), cache_view(cache_body("9")))
    assert ctx.scheduler.touched == []  # type: ignore[union-attr]
    ctx.wrote(KEY, "12")
    assert not ctx.written_shown(KEY, "11")  # the view is one version behind our write
    # The write's own watch event: due at once, and the next run goes ahead.
    ctx.on_cache(KEY, cache_view(cache_body("11")), cache_view(cache_body("12")))
    assert ctx.scheduler.touched == [KEY]  # type: ignore[union-attr]
    assert ctx.written_shown(KEY, "12")
    # A relist may bring a later version instead of the write's own event: a few seconds at most.
    ctx.wrote(KEY, "20")
    assert not ctx.written_shown(KEY, "19")
    now = state.time.monotonic()
    monkeypatch.setattr(state.time, "monotonic", lambda: now + state.WRITE_SHOWN_WAIT_S + 1)
    assert ctx.written_shown(KEY, "25")
    ctx.wrote(KEY, None)  # a write to a cache that is gone: nothing to wait for
    assert ctx.written_shown(KEY, "25")

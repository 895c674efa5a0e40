"""The list+watch cache of consumer pods/Jobs, and the controller's readiness gate."""

from __future__ import annotations

import asyncio

import pytest

from dscache_operator.cluster import views as views_mod
from dscache_operator.kube.informer import Gone, Informer, MultiInformer


def pod(uid, ns, cache, rv="1", node="n1"):
    return {
        "metadata": {
            "uid": uid,
            "namespace": ns,
            "name": uid,
            "resourceVersion": rv,
            "annotations": {"dscache.io/cache": cache},
        },
        "spec": {"nodeName": node},
        "status": {"phase": "Running"},
    }


class FakeKube:
    server = "https://x"

    def __init__(self, pages):
        self.pages = pages
        self.calls = []

    async def request(self, method, path, params=None, **_):
        self.calls.append(params)
        return self.pages[len(self.calls) - 1]


def test_list_pages_then_watch_events_update_the_view():
    pages = [
        {"items": [pod("a", "ml", "c1")], "metadata": {"continue": "tok", "resourceVersion": ""}},
        {"items": [pod("b", "ml", "c1", node="n2")], "metadata": {"resourceVersion": "10"}},
    ]
    kube = FakeKube(pages)
    inf = Informer(kube, "/api/v1/pods", "dscache.io/consumer=true", views_mod._pod_extract)
    rv = asyncio.run(inf._list())
    assert rv == "10" and len(inf) == 2
    assert kube.calls[1]["continue"] == "tok" and kube.calls[0]["labelSelector"] == "dscache.io/consumer=true"
    assert sorted(p.node for p in inf.get(("ml", "c1"))) == ["n1", "n2"]
    # MODIFIED moves nothing but updates the value; DELETED removes; BOOKMARK advances rv.
    m = pod("a", "ml", "c1", rv="11")
    m["status"]["phase"] = "Succeeded"
    assert inf._handle({"type": "MODIFIED", "object": m}, rv) == "11"
    assert {p.name: p.phase for p in inf.get(("ml", "c1"))} == {"a": "Succeeded", "b": "Running"}
    inf._handle({"type": "DELETED", "object": pod("b", "ml", "c1", rv="12")}, "11")
    assert [p.name for p in inf.get(("ml", "c1"))] == ["a"]
    assert inf._handle({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}}, "12") == "20"
    with pytest.raises(Gone):
        inf._handle({"type": "ERROR", "object": {"code": 410}}, "20")


def test_a_failed_relist_keeps_the_last_good_view():
    class Broken(FakeKube):
        async def request(self, *a, **k):
            raise OSError("apiserver down")

    inf = Informer(
        FakeKube([{"items": [pod("a", "ml", "c")], "metadata": {"resourceVersion": "5"}}]),
        "/p",
        "l",
        views_mod._pod_extract,
    )
    asyncio.run(inf._list())
    inf.kube = Broken([])
    with pytest.raises(OSError):
        asyncio.run(inf._list())
    assert len(inf) == 1


def test_empty_informers_count_as_ready():
    """Regression: an informer with no objects has len 0 (falsy) but is ready;
    with zero Jobs in the cluster nothing was ever planned or wiped."""
    views = views_mod.Views(FakeKube([]), ())
    assert not views.ready()
    for m in (views.caches, views.pods, views.nodes, *views.owners.values()):
        for i in m.informers.values():
            i.ready.set()
    assert len(views.pods) == 0 and views.ready()


def test_per_namespace_informers_route_by_namespace():
    m = MultiInformer(FakeKube([]), "/api/v1", "pods", ("a", "b"), "l", views_mod._pod_extract)
    assert set(m.informers) == {"a", "b"}
    assert m.informers["a"].path == "/api/v1/namespaces/a/pods"
    m.informers["b"]._upsert(pod("x", "b", "c"))
    assert [p.name for p in m.get(("b", "c"))] == ["x"] and m.get(("a", "c")) == []


def test_an_absent_optional_crd_is_an_empty_ready_view():
    """JobSet/PyTorchJob/... CRDs are optional: a 404 must not block the controller."""
    from dscache_operator.kube.client import ApiError

    class Absent(FakeKube):
        async def request(self, method, path, params=None, **_):
            self.calls.append(params)
            raise ApiError(404, "the server could not find the requested resource")

    async def main():
        inf = Informer(Absent([]), "/apis/kubeflow.org/v1/pytorchjobs", "", lambda b: None, optional=True)
        task = asyncio.create_task(inf.run())
        try:
            await asyncio.wait_for(inf.ready.wait(), 5)
            assert len(inf) == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())

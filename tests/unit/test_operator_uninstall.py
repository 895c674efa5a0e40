"""The pre-delete command (control/uninstall.py) against a fake API: it deletes every cache,
waits while a "controller" releases them, reports what is left, and gives up on its deadline."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from dscache_operator.control import uninstall as un
from dscache_operator.kube.client import ApiError


def cache(ns: str, name: str, finalizers: list[str], nodes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"namespace": ns, "name": name, "finalizers": finalizers}, "status": {"nodes": nodes or []}}


class FakeApi:
    """Caches by (ns, name); a DELETE marks them deleting; each list lets the "controller"
    release ``release_per_list`` deleting caches that carry only our finalizer."""

    def __init__(self, caches: list[dict[str, Any]], release_per_list: int = 1, crd: bool = True) -> None:
        self.caches = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in caches}
        self.release_per_list = release_per_list
        self.crd = crd
        self.deletes: list[str] = []
        self.lists: list[str] = []

    async def request(self, method: str, path: str, body: Any = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if not self.crd:
            raise ApiError(404, "the server could not find the requested resource")
        if method == "DELETE":
            ns, name = path.split("/")[-3], path.split("/")[-1]
            self.deletes.append(f"{ns}/{name}")
            self.caches[(ns, name)]["metadata"]["deletionTimestamp"] = "2026-11-21T12:00:00Z"
            return {}
        assert method == "GET"
        self.lists.append(path)
        released = 0
        for key, c in list(self.caches.items()):
            meta = c["metadata"]
            releasable = meta.get("deletionTimestamp") and meta["finalizers"] in ([], [un.FINALIZER])
            if releasable and released < self.release_per_list:
                del self.caches[key]
                released += 1
        parts = path.split("/")
        ns = parts[parts.index("namespaces") + 1] if "namespaces" in parts else None
        return {"items": [c for (n, _), c in self.caches.items() if ns in (None, n)]}


def run(api: FakeApi, namespaces: list[str], timeout: float) -> int:
    return asyncio.run(un.uninstall(api, namespaces, timeout, interval=0.01))  # type: ignore[arg-type]


def test_deletes_every_cache_and_waits_for_the_controller(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, "dscache.uninstall")
    api = FakeApi([cache("ml", f"c{i}", [un.FINALIZER]) for i in range(3)] + [cache("other", "x", [un.FINALIZER])])
    assert run(api, ["ml"], timeout=10) == 0
    assert sorted(api.deletes) == ["ml/c0", "ml/c1", "ml/c2"]  # only where the operator serves
    assert ("other", "x") in api.caches
    assert all("/namespaces/ml/" in p for p in api.lists)
    assert "deleting 3 DatasetCache(s) in ml" in caplog.text
    assert "2 of 3 left" in caplog.text and "1 of 3 left" in caplog.text  # progress
    assert "done in" in caplog.text


def test_cluster_wide_lists_every_namespace():
    api = FakeApi([cache("a", "x", []), cache("b", "y", [un.FINALIZER])], release_per_list=5)
    assert run(api, [], timeout=10) == 0
    assert api.lists[0] == "/apis/dscache.io/v1alpha1/datasetcaches" and not api.caches


def test_gives_up_on_the_deadline_naming_what_is_left(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, "dscache.uninstall")
    nodes = [
        {"node": "n1", "state": "Ready", "consumers": 2},
        {"node": "n2", "state": "Wiped"},
        {"node": "n3", "state": "Ready", "volume": "EmptyDir"},
    ]
    api = FakeApi([cache("ml", "busy", [un.FINALIZER], nodes), cache("ml", "held", ["example.com/hold", un.FINALIZER])])
    api.release_per_list = 0  # the controller never releases (pods still use one, another holds the other)
    assert run(api, ["ml"], timeout=0.05) == 1
    assert "ml/busy (2 pod(s) still use it; copies on n1)" in caplog.text
    assert "ml/held (other finalizers example.com/hold)" in caplog.text
    assert "helm uninstall --no-hooks" in caplog.text


def test_no_crd_is_nothing_to_do():
    api = FakeApi([], crd=False)
    assert run(api, [], timeout=1) == 0 and api.deletes == []


def test_forbidden_fails_at_once():
    class Forbidden(FakeApi):
        async def request(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            raise ApiError(403, "forbidden")

    with pytest.raises(ApiError):
        run(Forbidden([]), ["ml"], timeout=10)


def test_describe_names_node_copies_of_every_node_mode():
    """A CSI volume's copy is a node copy as much as a hostPath's; an emptyDir went with its pod."""
    cache = {
        "metadata": {"namespace": "ml", "name": "ds", "deletionTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "nodes": [
                {"node": "a", "state": "Ready", "volume": "CSI"},
                {"node": "b", "state": "Ready", "volume": "HostPath"},
                {"node": "c", "state": "Ready", "volume": "EmptyDir"},
                {"node": "d", "state": "Wiped", "volume": "CSI"},
            ]
        },
    }
    assert un.describe(cache) == "ml/ds (copies on a, b)"

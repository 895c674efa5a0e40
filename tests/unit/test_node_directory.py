"""The agent's answer to "who stages or holds this revision" comes from watched Node labels
(issue 30): one listing per label, then the watch's events; no API call per question."""

from __future__ import annotations

import queue
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

import dscache_contract as contract
from dscache_contract.peers import staging_label
from dscache_node import peers as agent_peers
from dscache_node.kube import ApiError
from dscache_node.peers import Directory

NS, CACHE, REV = "ml", "imagenet", "r-0123456789abcdef0123"
STAGING = staging_label(NS, CACHE, REV)
WARM = contract.warm_label(NS, CACHE, REV)


def node(name: str, ip: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {contract.AGENT_LABEL: "9478", **labels}},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
    }


class WatchKube:
    """Nodes in memory; a list filters them by the selector's one label; a watch yields what a
    test puts in that label's queue (an exception is raised, None ends the watch)."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.lists: list[str] = []
        self.watches: list[str] = []
        self.events: dict[str, queue.Queue[dict[str, Any] | Exception | None]] = {
            STAGING: queue.Queue(),
            WARM: queue.Queue(),
        }
        self.fail_lists = False

    @staticmethod
    def _label(path: str) -> str:
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        return q["labelSelector"][0]

    def get(self, path: str) -> dict[str, Any] | None:
        if path.startswith("/api/v1/nodes/"):
            return self.nodes.get(path.rsplit("/", 1)[1])
        label = self._label(path)
        self.lists.append(label)
        if self.fail_lists:
            raise ApiError(503, "unavailable")
        items = [n for n in self.nodes.values() if label in n["metadata"]["labels"]]
        return {"metadata": {"resourceVersion": "7"}, "items": items}

    def watch(self, path: str, timeout_seconds: int = 300) -> Iterator[dict[str, Any]]:
        label = self._label(path)
        self.watches.append(label)
        while True:
            ev = self.events[label].get()
            if ev is None:
                return
            if isinstance(ev, Exception):
                raise ev
            yield ev


def wait_until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def kube() -> Iterator[WatchKube]:
    k = WatchKube(
        [
            node("me", "10.0.0.1", {STAGING: "100.0"}),
            node("b", "10.0.0.2", {STAGING: "101.5"}),
            node("c", "10.0.0.3", {WARM: "true"}),
            node("d", "10.0.0.4", {}),
        ]
    )
    yield k
    for q in k.events.values():
        q.put(None)  # end the views' watches


def addrs(peers: list[Any]) -> list[tuple[str, float]]:
    return sorted((p.addr, p.since) for p in peers)


def test_answers_come_from_the_view_without_an_api_call(kube: WatchKube) -> None:
    d = Directory(kube, "me")  # type: ignore[arg-type]
    first = d.answer(NS, CACHE, REV, fresh=True)
    assert first.me == "10.0.0.1:9478"
    assert addrs(first.staging) == [("10.0.0.1:9478", 100.0), ("10.0.0.2:9478", 101.5)]
    assert [p.addr for p in first.complete] == ["10.0.0.3:9478"]
    wait_until(lambda: len(kube.watches) == 2)
    lists = len(kube.lists)
    for _ in range(20):
        again = d.answer(NS, CACHE, REV)
        assert addrs(again.staging) == addrs(first.staging)
        assert [p.addr for p in again.complete] == ["10.0.0.3:9478"]
    assert len(kube.lists) == lists  # read from memory: no list per question


def test_watch_events_change_the_answer(kube: WatchKube, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_peers, "ANSWER_TTL_S", 0.0)
    monkeypatch.setattr(agent_peers, "LEFT_GRACE_S", 0.0)  # a node that leaves goes at once (see below)
    d = Directory(kube, "me")  # type: ignore[arg-type]
    d.answer(NS, CACHE, REV, fresh=True)
    wait_until(lambda: len(kube.watches) == 2)
    # A node starts staging; one is done (its staging label goes); another one completes.
    kube.events[STAGING].put({"type": "ADDED", "object": node("d", "10.0.0.4", {STAGING: "102.0"})})
    kube.events[STAGING].put({"type": "DELETED", "object": node("b", "10.0.0.2", {})})
    kube.events[WARM].put({"type": "ADDED", "object": node("b", "10.0.0.2", {WARM: "true"})})
    kube.events[WARM].put({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}})
    want = [("10.0.0.1:9478", 100.0), ("10.0.0.4:9478", 102.0)]
    wait_until(lambda: addrs(d.answer(NS, CACHE, REV).staging) == want)
    wait_until(lambda: sorted(p.addr for p in d.answer(NS, CACHE, REV).complete) == ["10.0.0.2:9478", "10.0.0.3:9478"])
    # A Node that loses its agent label (no address any more) is nobody's peer.
    kube.events[STAGING].put({"type": "MODIFIED", "object": {"metadata": {"name": "d", "labels": {STAGING: "1"}}}})
    wait_until(lambda: addrs(d.answer(NS, CACHE, REV).staging) == [("10.0.0.1:9478", 100.0)])


def test_a_failed_watch_falls_back_to_listing_then_watches_again(
    kube: WatchKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_peers, "RETRY_S", 0.2)
    monkeypatch.setattr(agent_peers, "LEFT_GRACE_S", 0.0)  # b, gone below, goes at once
    d = Directory(kube, "me")  # type: ignore[arg-type]
    d.answer(NS, CACHE, REV, fresh=True)
    wait_until(lambda: len(kube.watches) == 2)
    kube.fail_lists = True
    kube.events[STAGING].put(ApiError(500, "watch broke"))
    view = d._views[STAGING]
    wait_until(lambda: not view.synced)
    # Not synced: the answer lists for itself (and says so when that fails too: no peers).
    before = len(kube.lists)
    assert d.answer(NS, CACHE, REV, fresh=True).staging == []
    assert len(kube.lists) > before
    kube.fail_lists = False
    kube.nodes["b"]["metadata"]["labels"].pop(STAGING)  # changed while nobody watched
    wait_until(lambda: view.synced and kube.watches.count(STAGING) == 2)
    assert addrs(d.answer(NS, CACHE, REV).staging) == [("10.0.0.1:9478", 100.0)]


def test_a_view_nobody_asks_about_ends(kube: WatchKube, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_peers, "VIEW_IDLE_S", 0.2)
    d = Directory(kube, "me")  # type: ignore[arg-type]
    d.answer(NS, CACHE, REV, fresh=True)
    wait_until(lambda: len(kube.watches) == 2)
    views = list(d._views.values())
    time.sleep(0.3)
    kube.events[STAGING].put({"type": "BOOKMARK", "object": {}})
    kube.events[WARM].put(None)
    wait_until(lambda: all(v.done.is_set() for v in views))
    # Asked again: a new view (a new listing and watch).
    d.answer(NS, CACHE, REV)
    wait_until(lambda: len(kube.watches) == 4)
    assert not any(t.name == "label-view" and not t.is_alive() for t in threading.enumerate())


def test_a_completed_copy_stays_in_the_answer_between_its_two_label_events(
    kube: WatchKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that completes moves its Node from the staging label to the warm one in one patch; the
    two labels are watched apart. An answer between the two events lacked the node altogether, and
    its peers read again from the bucket what it had read (issue 30, N = 8): it stays staging until
    the warm view has it, or LEFT_GRACE_S."""
    monkeypatch.setattr(agent_peers, "ANSWER_TTL_S", 0.0)
    monkeypatch.setattr(agent_peers, "LEFT_GRACE_S", 2.0)
    d = Directory(kube, "me")  # type: ignore[arg-type]
    d.answer(NS, CACHE, REV, fresh=True)
    wait_until(lambda: len(kube.watches) == 2)

    def staged() -> list[str]:
        view = d._views[STAGING].read() or []
        return [addr for addr, _ in view]

    def answered() -> tuple[list[str], list[str]]:
        a = d.answer(NS, CACHE, REV)
        return [p.addr for p in a.staging], [p.addr for p in a.complete]

    kube.events[STAGING].put({"type": "DELETED", "object": node("b", "10.0.0.2", {})})
    wait_until(lambda: "10.0.0.2:9478" not in staged())
    # The staging view without b, the warm view without it yet: b is still a peer that stages.
    assert answered() == (["10.0.0.1:9478", "10.0.0.2:9478"], ["10.0.0.3:9478"])
    kube.events[WARM].put({"type": "ADDED", "object": node("b", "10.0.0.2", {WARM: "true"})})
    wait_until(lambda: answered() == (["10.0.0.1:9478"], ["10.0.0.2:9478", "10.0.0.3:9478"]))
    # A node that leaves without completing is answered LEFT_GRACE_S more, then no longer.
    kube.events[STAGING].put({"type": "ADDED", "object": node("d", "10.0.0.4", {STAGING: "102.0"})})
    wait_until(lambda: "10.0.0.4:9478" in staged())
    assert "10.0.0.4:9478" in answered()[0]
    kube.events[STAGING].put({"type": "DELETED", "object": node("d", "10.0.0.4", {})})
    wait_until(lambda: "10.0.0.4:9478" not in staged())
    assert "10.0.0.4:9478" in answered()[0]
    time.sleep(agent_peers.LEFT_GRACE_S)
    assert answered()[0] == ["10.0.0.1:9478"]

"""A stager's first question about a revision costs its agent one label PATCH and its views' two
lists at once, not a PATCH, two lists and a GET in turn (issue 30: at N = 32 each took 1-5 s on the
loaded API server, and the stager gave up after 10 s and read every object from the bucket)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dscache_node import peers as agent_peers
from dscache_node.peers import Directory
from tests.unit.test_node_directory import CACHE, NS, REV, STAGING, WARM, WatchKube, addrs, node


class SlowKube(WatchKube):
    """Lists take ``LIST_S`` each; counts the GETs of single Nodes."""

    LIST_S = 0.3

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        super().__init__(nodes)
        self.node_gets: list[str] = []
        self.listing = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def get(self, path: str) -> dict[str, Any] | None:
        if path.startswith("/api/v1/nodes/"):
            self.node_gets.append(path)
            return super().get(path)
        with self._lock:
            self.listing += 1
            self.most_at_once = max(self.most_at_once, self.listing)
        try:
            time.sleep(self.LIST_S)
            return super().get(path)
        finally:
            with self._lock:
                self.listing -= 1


@pytest.fixture
def kube() -> Iterator[SlowKube]:
    # "me" is not labelled yet as the views list: its PATCH is in flight.
    k = SlowKube(
        [node("me", "10.0.0.1", {}), node("b", "10.0.0.2", {STAGING: "101.5"}), node("c", "10.0.0.3", {WARM: "1"})]
    )
    yield k
    for q in k.events.values():
        q.put(None)


@pytest.fixture(autouse=True)
def _short_own_label_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_peers, "OWN_LABEL_BY_S", 0.5)


def test_first_question_lists_once_per_label_at_once_and_needs_no_get(kube: SlowKube) -> None:
    d = Directory(kube, "me")  # type: ignore[arg-type]
    d.prepare(NS, CACHE, REV)  # as the agent does before it writes the label
    d.learn(node("me", "10.0.0.1", {STAGING: "100.0"}))  # the PATCH's answer
    first = d.answer(NS, CACHE, REV, fresh=True, since=100.0)
    # Its own label is in the answer although the views listed before it was written.
    assert addrs(first.staging) == [("10.0.0.1:9478", 100.0), ("10.0.0.2:9478", 101.5)]
    assert [p.addr for p in first.complete] == ["10.0.0.3:9478"]
    assert first.me == "10.0.0.1:9478"
    assert sorted(kube.lists) == sorted([STAGING, WARM])  # the views' lists only: none of its own
    assert kube.most_at_once == 2  # side by side
    assert kube.node_gets == []  # its own address came with the PATCH's answer


def test_first_answer_waits_for_its_own_label_and_so_has_every_earlier_one(
    kube: SlowKube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node labelled while this one's views listed (d) comes by the watch, before this node's own
    label (events come in order): the first answer waits for its own, so it has d too."""
    monkeypatch.setattr(agent_peers, "OWN_LABEL_BY_S", 10.0)
    d = Directory(kube, "me")  # type: ignore[arg-type]
    d.prepare(NS, CACHE, REV)
    d.learn(node("me", "10.0.0.1", {STAGING: "100.0"}))

    def events() -> None:
        time.sleep(SlowKube.LIST_S + 0.3)  # after the views' lists
        kube.events[STAGING].put({"type": "ADDED", "object": node("d", "10.0.0.4", {STAGING: "100.5"})})
        time.sleep(0.3)
        kube.events[STAGING].put({"type": "ADDED", "object": node("me", "10.0.0.1", {STAGING: "100.0"})})

    threading.Thread(target=events, daemon=True).start()
    t0 = time.monotonic()
    first = d.answer(NS, CACHE, REV, fresh=True, since=100.0)
    assert time.monotonic() - t0 < 5.0  # not OWN_LABEL_BY_S: its own label's event ended the wait
    assert addrs(first.staging) == [("10.0.0.1:9478", 100.0), ("10.0.0.2:9478", 101.5), ("10.0.0.4:9478", 100.5)]


def test_first_question_lists_for_itself_when_the_views_fail(kube: SlowKube, monkeypatch: pytest.MonkeyPatch) -> None:
    """A view that cannot list does not hold the question for VIEW_WAIT_S: it lists for itself."""
    monkeypatch.setattr(agent_peers, "VIEW_WAIT_S", 30.0)
    monkeypatch.setattr(agent_peers, "RETRY_S", 30.0)
    kube.fail_lists = True
    d = Directory(kube, "me")  # type: ignore[arg-type]
    t0 = time.monotonic()
    got = d.answer(NS, CACHE, REV, fresh=True, since=100.0)
    assert time.monotonic() - t0 < 5.0
    # No peers (said in the log: slower, never wrong); itself, as it stages.
    assert addrs(got.staging) == [("10.0.0.1:9478", 100.0)] and got.complete == []
    assert len(kube.lists) == 4  # the views' two, then its own two


def test_later_questions_keep_its_own_label_before_the_watch_sees_it(kube: SlowKube) -> None:
    """Its own entry stays in the answers, though its label's watch event has not come yet: a
    node missing from its own answer would rank every peer before itself for every object."""
    d = Directory(kube, "me")  # type: ignore[arg-type]
    d.learn(node("me", "10.0.0.1", {STAGING: "100.0"}))
    d.answer(NS, CACHE, REV, fresh=True, since=100.0)
    later = d.answer(NS, CACHE, REV, since=100.0)
    assert addrs(later.staging) == [("10.0.0.1:9478", 100.0), ("10.0.0.2:9478", 101.5)]
    assert sorted(kube.lists) == sorted([STAGING, WARM])  # from the views


def test_me_is_asked_for_when_the_patch_did_not_say(kube: SlowKube) -> None:
    d = Directory(kube, "me")  # type: ignore[arg-type]
    d.learn(None)
    assert d.answer(NS, CACHE, REV, fresh=True, since=100.0).me == "10.0.0.1:9478"
    assert kube.node_gets == ["/api/v1/nodes/me"]

"""Events are aggregated like client-go's EventCorrelator (kube/events.py): one Event per
(object, type, reason, message) with a deterministic name, a repeat counted on it by PATCH.
A fake API server that keeps Events by name and answers 404/409 as the real one does."""

from __future__ import annotations

import asyncio
import datetime
import json
from typing import Any

import pytest

from dscache_operator.kube import events as ev
from dscache_operator.kube.client import ApiError

T0 = datetime.datetime(2026, 11, 21, 12, 0, 0, tzinfo=datetime.UTC)
CACHE = {"apiVersion": "dscache.io/v1alpha1", "kind": "DatasetCache", "namespace": "ml", "name": "ds", "uid": "u-1"}


class FakeApi:
    """Events in a dict by (namespace, name); every call recorded as (method, path)."""

    def __init__(self) -> None:
        self.store: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
        answer: bool = True,
    ) -> dict[str, Any]:
        self.calls.append((method, path))
        if method == "POST":
            key = f"{path}/{body['metadata']['name']}"
            if key in self.store:
                raise ApiError(409, "AlreadyExists")
            self.store[key] = json.loads(json.dumps(body))
            return {}
        if path not in self.store:
            raise ApiError(404, "NotFound")
        if method == "GET":
            return json.loads(json.dumps(self.store[path]))
        if method == "PATCH":
            assert content_type == "application/merge-patch+json"
            self.store[path].update(body)
            return {}
        raise AssertionError(method)


def send(poster: ev.Poster, e: ev.Event, at: datetime.datetime = T0) -> None:
    asyncio.run(poster.send(e, at))


def test_a_repeat_counts_on_one_event_with_a_deterministic_name():
    api = FakeApi()
    poster = ev.Poster(api)  # type: ignore[arg-type]
    e = ev.Event(CACHE, "Warning", "WipeFailed", "node-a did not answer; retrying")
    for i in range(3):
        send(poster, e, T0 + datetime.timedelta(seconds=i * 10))
    (only,) = api.store.values()
    assert only["count"] == 3
    assert only["firstTimestamp"] == "2026-11-21T12:00:00Z"
    assert only["lastTimestamp"] == "2026-11-21T12:00:20Z"
    assert only["metadata"]["name"] == ev.event_name(e) and only["metadata"]["name"].startswith("ds.")
    assert [m for m, _ in api.calls] == ["POST", "PATCH", "PATCH"]
    # The same fact names the same Event in any process; another message, reason or object does not.
    assert ev.event_name(ev.Event(dict(CACHE), "Warning", "WipeFailed", e.message)) == ev.event_name(e)
    others = {
        ev.event_name(ev.Event(CACHE, "Warning", "WipeFailed", "node-b did not answer; retrying")),
        ev.event_name(ev.Event(CACHE, "Warning", "Wiped", e.message)),
        ev.event_name(ev.Event({**CACHE, "uid": "u-2"}, "Warning", "WipeFailed", e.message)),
    }
    assert len(others) == 3 and ev.event_name(e) not in others


def test_different_facts_are_different_events():
    api = FakeApi()
    poster = ev.Poster(api)  # type: ignore[arg-type]
    send(poster, ev.Event(CACHE, "Normal", "RevisionPinned", "r-1"))
    send(poster, ev.Event(CACHE, "Normal", "RevisionPinned", "r-2"))
    assert sorted(e["message"] for e in api.store.values()) == ["r-1", "r-2"]
    assert all(e["count"] == 1 for e in api.store.values())


def test_after_the_window_or_a_restart_the_servers_count_goes_on():
    """Forgotten locally (window passed, or a new process): the create meets 409, and the
    count the API server holds is read and incremented, not restarted at 1."""
    api = FakeApi()
    e = ev.Event(CACHE, "Normal", "DeletionWaiting", "2 pod(s) still use this cache")
    first = ev.Poster(api, window=0.0)  # type: ignore[arg-type]
    send(first, e)
    send(first, e)  # window 0: forgotten at once
    restarted = ev.Poster(api)  # type: ignore[arg-type]
    send(restarted, e)
    (only,) = api.store.values()
    assert only["count"] == 3
    assert [m for m, _ in api.calls] == ["POST", "POST", "GET", "PATCH", "POST", "GET", "PATCH"]


def test_an_expired_event_is_created_anew():
    """The API server dropped the Event (TTL): the PATCH's 404 leads to a new one with count 1."""
    api = FakeApi()
    poster = ev.Poster(api)  # type: ignore[arg-type]
    e = ev.Event(CACHE, "Normal", "Wiped", "node-a")
    send(poster, e)
    api.store.clear()
    send(poster, e, T0 + datetime.timedelta(minutes=5))
    (only,) = api.store.values()
    assert (only["count"], only["firstTimestamp"]) == (1, "2026-11-21T12:05:00Z")
    assert [m for m, _ in api.calls] == ["POST", "PATCH", "POST"]


def test_the_correlator_is_bounded():
    c = ev.Correlator(window=60, remembered=3)
    for i in range(10):
        c.said(f"e{i}", 1, now=0.0)
    assert [n for n in ("e6", "e7", "e8", "e9") if c.recent(n, 1.0)] == ["e7", "e8", "e9"]
    assert c.recent("e9", 61.5) is None  # past the window: forgotten


def test_names_are_valid_for_long_objects():
    e = ev.Event({**CACHE, "name": "x" * 253}, "Normal", "Wiped", "m" * 5000)
    name = ev.event_name(e)
    assert len(name) <= 253 and len(name.rsplit(".", 1)[1]) == 16
    assert len(ev.event_body(e, T0)["message"]) == 1024  # type: ignore[arg-type]


def test_other_api_errors_reach_the_caller():
    class Refusing(FakeApi):
        async def request(self, method: str, path: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
            raise ApiError(403, "forbidden")

    with pytest.raises(ApiError):
        send(ev.Poster(Refusing()), ev.Event(CACHE, "Normal", "Wiped", "x"))  # type: ignore[arg-type]

"""Kubernetes Events about DatasetCaches, posted in the background from a bounded queue,
and aggregated the way client-go's EventCorrelator does.

Reconciliation only queues them (it never waits on the API server for an
Event). The queue is bounded so that 10,000 caches pinning their first
revision at once cost a fixed amount of memory: past the bound, Events are
dropped and counted in the log (status carries the same facts).

Aggregation: an Event's name is a digest of what it says (involved object's
uid, type, reason, message), so the same fact always has the same name. The
first time it is said it is created with count 1; a repeat within ``window``
seconds of the last one PATCHes that Event's ``count`` and ``lastTimestamp``
instead of creating a new Event (client-go's EventLogger does the same, keyed
the same way). The window bounds what we remember, not what is aggregated: a
repeat after it, or after a restart, is created again, and if the API server
still holds the Event (its TTL is an hour by default) the 409 leads to a GET
and the PATCH of the count the server has. Who writes: only this process's one
poster task, so the count needs no optimistic lock.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from dscache_contract import clock

from .client import ApiError

logger = logging.getLogger(__name__)

COMPONENT = "dscache-controller"
#: client-go's aggregation window (EventAggregator's maxIntervalInSeconds): 10 minutes.
WINDOW_S = 600.0
#: client-go's EventLogger keeps 4096 entries (LRU): a fixed amount of memory at any scale.
REMEMBERED = 4096
#: An Event's name is a DNS subdomain (253): the involved name, cut, then "." and the digest.
NAME_PREFIX_MAX = 200


class Api(Protocol):
    """The one call of kube.client.Kube the poster needs (a fake in the unit tests)."""

    async def request(
        self,
        method: str,
        path: str,
        body: object = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
        answer: bool = True,
    ) -> dict[str, object]: ...


class Event(NamedTuple):
    involved: dict[str, str]  # apiVersion, kind, namespace, name, uid
    type: str  # Normal | Warning
    reason: str
    message: str


def event_name(e: Event) -> str:
    """Deterministic: the same object, type, reason and message always name the same Event."""
    key = "\x00".join(
        (e.involved.get("uid", ""), e.involved.get("kind", ""), e.involved["name"], e.type, e.reason, _message(e))
    )
    return f"{e.involved['name'][:NAME_PREFIX_MAX]}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _message(e: Event) -> str:
    return e.message[:1024]


def event_body(e: Event, now: datetime.datetime) -> dict[str, object]:
    stamp = clock.fmt_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name(e), "namespace": e.involved["namespace"]},
        "involvedObject": e.involved,
        "type": e.type,
        "reason": e.reason,
        "message": _message(e),
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


@dataclass
class _Seen:
    count: int
    at: float  # monotonic time of the last sighting


class Correlator:
    """What was said recently: name -> its count and when it was last said (LRU, bounded)."""

    def __init__(self, window: float = WINDOW_S, remembered: int = REMEMBERED) -> None:
        self.window = window
        self.remembered = remembered
        self._seen: collections.OrderedDict[str, _Seen] = collections.OrderedDict()

    def recent(self, name: str, now: float) -> _Seen | None:
        """The entry if ``name`` was said within the window (else it is forgotten)."""
        seen = self._seen.get(name)
        if seen is None:
            return None
        if now - seen.at > self.window:
            del self._seen[name]
            return None
        return seen

    def said(self, name: str, count: int, now: float) -> None:
        self._seen[name] = _Seen(count, now)
        self._seen.move_to_end(name)
        while len(self._seen) > self.remembered:
            self._seen.popitem(last=False)


class Poster:
    def __init__(self, kube: Api, bound: int = 1000, window: float = WINDOW_S) -> None:
        self._kube = kube
        self._queue: asyncio.Queue[Event] = asyncio.Queue(bound)
        self.correlator = Correlator(window)
        self.dropped = 0

    def post(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                logger.warning(f"{self.dropped} Event(s) dropped so far: the API server is not keeping up")

    async def run(self) -> None:
        while True:
            e = await self._queue.get()
            try:
                await self.send(e)
            except Exception as err:  # an Event is never worth stopping for
                logger.warning(
                    f"posting Event {e.reason} on {e.involved['namespace']}/{e.involved['name']} failed: {err}"
                )

    async def send(self, e: Event, now: datetime.datetime | None = None) -> None:
        """Create the Event, or count a repeat on the one already there."""
        now = now or clock.now()
        name = event_name(e)
        events = f"/api/v1/namespaces/{e.involved['namespace']}/events"
        seen = self.correlator.recent(name, time.monotonic())
        if seen is not None and await self._count(f"{events}/{name}", seen.count + 1, now):
            self.correlator.said(name, seen.count + 1, time.monotonic())
            return
        try:
            await self._kube.request("POST", events, event_body(e, now), answer=False)
            self.correlator.said(name, 1, time.monotonic())
            return
        except ApiError as err:
            if err.status != 409:
                raise
        # Already there (said before the window, or before a restart): count on from the server's.
        try:
            current = await self._kube.request("GET", f"{events}/{name}")
        except ApiError as err:
            if err.status != 404:
                raise
            # Expired between the two calls: it is new again.
            await self._kube.request("POST", events, event_body(e, now), answer=False)
            self.correlator.said(name, 1, time.monotonic())
            return
        count = int(str(current.get("count") or 1)) + 1
        if await self._count(f"{events}/{name}", count, now):
            self.correlator.said(name, count, time.monotonic())

    async def _count(self, path: str, count: int, now: datetime.datetime) -> bool:
        """PATCH count and lastTimestamp; False if the Event is gone (expired: create it anew)."""
        patch = {"count": count, "lastTimestamp": clock.fmt_time(now)}
        try:
            await self._kube.request("PATCH", path, patch, "application/merge-patch+json", answer=False)
        except ApiError as err:
            if err.status == 404:
                return False
            raise
        return True

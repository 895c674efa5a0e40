"""Kubernetes Events about DatasetCaches, posted in the background from a bounded queue.

Reconciliation only queues them (it never waits on the API server for an
Event). The queue is bounded so that 10,000 caches pinning their first
revision at once cost a fixed amount of memory: past the bound, Events are
dropped and counted in the log (status carries the same facts).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from typing import NamedTuple

from dscache_contract import clock

from .client import Kube

logger = logging.getLogger(__name__)

COMPONENT = "dscache-controller"


class Event(NamedTuple):
    involved: dict[str, str]  # apiVersion, kind, namespace, name, uid
    type: str  # Normal | Warning
    reason: str
    message: str


def event_body(e: Event, now: datetime.datetime) -> dict[str, object]:
    stamp = clock.fmt_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{e.involved['name']}.{secrets.token_hex(8)}", "namespace": e.involved["namespace"]},
        "involvedObject": e.involved,
        "type": e.type,
        "reason": e.reason,
        "message": e.message[:1024],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class Poster:
    def __init__(self, kube: Kube, bound: int = 1000) -> None:
        self._kube = kube
        self._queue: asyncio.Queue[Event] = asyncio.Queue(bound)
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
            namespace = e.involved["namespace"]
            try:
                body = event_body(e, clock.now())
                await self._kube.request("POST", f"/api/v1/namespaces/{namespace}/events", body, answer=False)
            except Exception as err:  # an Event is never worth stopping for
                logger.warning(f"posting Event {e.reason} on {namespace}/{e.involved['name']} failed: {err}")

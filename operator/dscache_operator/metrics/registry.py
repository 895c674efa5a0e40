"""Prometheus metrics (prometheus_client), served on ``DSCACHE_METRICS_PORT`` at ``/metrics``.

Both processes serve one: the controller (caches by phase, node copies by
state, source checks, wipes, and what each stager reported), the webhook
(admission reviews by outcome and their latency). Each process's ``Metrics``
owns its own ``CollectorRegistry`` (it lives in the Context, never in the
global default registry), so tests get fresh, isolated counters.

Series are created at zero when their labels become known: the per-cache ones
when the controller first reconciles the cache (and removed when it is
deleted), the others at start-up, so that ``rate()`` and alerts see a 0
rather than no data.
"""

from __future__ import annotations

import datetime
import logging
import platform
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from dscache_contract.clock import now, parse_time

from ..api.models import VolumeMode
from ..version import package_version
from .cacheseries import STAGER_RESULTS, CacheSeries

if TYPE_CHECKING:
    from ..cluster.workloads import PodInfo

logger = logging.getLogger(__name__)

ADMISSION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ADMISSION_RESULTS = ("admitted", "refused", "error")
#: The reasons sourcecheck.py gives; others still count, they just start from nothing.
SOURCE_REASONS = ("Listed", "NoSuchBucket", "AccessDenied", "EndpointUnreachable", "SecretNotFound")


class Metrics:
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        role: str | None = None,
        version: str | None = None,
        since: datetime.datetime | None = None,
    ) -> None:
        """``role``: "controller" or "webhook" exports only that process's families
        (the other's would be constant zeros, and a webhook reporting 0 caches
        reads as a fact); None (tests) exports both."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # A family outside this role is still created (callers need no checks) but never registered.
        ctl = r if role in (None, "controller") else None
        hook = r if role in (None, "webhook") else None
        #: Stagers that finished before this time are never counted (see observe_stagers).
        self.since = since or now()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Gauge(
            "dscache_build_info", "The running dscache version (always 1).", ["version", "python"], registry=r
        )
        self.build_info.labels(version or package_version(), platform.python_version()).set(1)

        #: The per-cache series and the inventory gauges (cacheseries.py: why not prometheus_client's children).
        self.caches = CacheSeries()
        if ctl is not None:
            r.register(self.caches)
        self.source_checks = Counter("dscache_source_checks", "Source checks by reason.", ["reason"], registry=ctl)
        for reason in SOURCE_REASONS:
            self.source_checks.labels(reason)
        self.source_listings = Counter(
            "dscache_source_listings", "S3 listings made for source checks (equal checks share one).", registry=ctl
        )
        self.prestaged = Gauge(
            "dscache_prestaged_bytes",
            "Bytes of the current revision pre-staged on each node that holds it (spec.prestage), per cache.",
            ["namespace", "cache", "node"],
            registry=ctl,
        )
        self.leader = Gauge(
            "dscache_controller_leader",
            "1 while this controller replica holds the leader-election Lease and reconciles; 0 on a standby.",
            registry=ctl,
        )
        #: cache -> the nodes it has a dscache_prestaged_bytes series for
        self._prestaged_nodes: dict[tuple[str, str], set[str]] = {}
        #: cache -> the stager runs already counted: (pod uid, init container startedAt)
        self._counted: dict[tuple[str, str], set[tuple[str, str]]] = {}

        self.admission_reviews = Counter(
            "dscache_admission_reviews", "AdmissionReviews by outcome.", ["mode", "result"], registry=hook
        )
        for mode in VolumeMode:
            for result in ADMISSION_RESULTS:
                self.admission_reviews.labels(mode.value, result)
        self.admission_seconds = Histogram(
            "dscache_admission_seconds", "Time to answer an AdmissionReview.", buckets=ADMISSION_BUCKETS, registry=hook
        )

    # --- controller ----------------------------------------------------------------------

    def source_checked(self, reason: str) -> None:
        self.source_checks.labels(reason).inc()

    def source_listed(self) -> None:
        self.source_listings.inc()

    def wipe(self, namespace: str, name: str, result: str) -> None:
        self.caches.wipe((namespace, name), result)

    def set_cache(self, namespace: str, name: str, phase: str, states: Iterable[str]) -> None:
        self.caches.set((namespace, name), phase, states)

    def set_prestaged(self, namespace: str, name: str, nodes: dict[str, int]) -> None:
        """``nodes``: node -> bytes pre-staged there now; nodes no longer listed are dropped."""
        for node in self._prestaged_nodes.pop((namespace, name), set()) - set(nodes):
            self.prestaged.remove(namespace, name, node)
        if nodes:
            self._prestaged_nodes[(namespace, name)] = set(nodes)
        for node, nbytes in nodes.items():
            self.prestaged.labels(namespace, name, node).set(nbytes)

    def forget_cache(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self.set_prestaged(namespace, name, {})
        self.caches.forget(key)
        self._counted.pop(key, None)

    def observe_stagers(self, namespace: str, name: str, pods: Iterable[PodInfo]) -> int:
        """Count each finished stager run of the cache's pods once; return how many were new.

        The controller learns a stager's result from the pod view (the init
        container's termination message holds the JSON StageSummary), and sees
        the same finished pod on every reconciliation, so a run is keyed by
        (pod UID, the init container's startedAt): a pod whose stager restarts
        (restartPolicy OnFailure) counts each attempt once.

        Restarts: the keys live in memory, and a restarted operator re-sees every
        finished pod still in the API server. We count only runs that finished
        after this process started (``since``, against the kubelet's finishedAt).
        So a restart never counts a run twice (the old process's counts were
        scraped before its counters went away with it), at the price of never
        counting runs that finished while no controller ran. Undercounting
        across a gap is the lesser harm: Prometheus sees a counter reset either
        way, and an inflated increase() would fire alerts for failures that
        were already handled.
        """
        key = (namespace, name)
        counted = self._counted.setdefault(key, set())
        present: set[tuple[str, str]] = set()
        new = 0
        for p in pods:
            if p.init not in STAGER_RESULTS or not p.uid:
                continue
            run = (p.uid, p.started or "")
            present.add(run)
            if run in counted:
                continue
            counted.add(run)
            finished = parse_time(p.init_finished)
            if finished is None or finished < self.since.replace(microsecond=0):
                continue
            new += 1
            self.caches.stager_run(key, p.init)
            if p.summary is not None:
                s = p.summary
                reused = max(0, s.bytes - s.fetched_bytes)
                self.caches.staged(key, s.seconds, s.fetched_bytes, reused, s.bucket_bytes, s.peer_bytes)
        # Forget the runs of pods gone from the view: the set stays as small as the view.
        counted &= present
        return new

    # --- webhook -------------------------------------------------------------------------

    def admission(self, mode: str, result: str, seconds: float) -> None:
        self.admission_seconds.observe(seconds)
        self.admission_reviews.labels(mode, result).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve(port: int, metrics: Metrics) -> web.AppRunner | None:
    if not port:
        return None

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes([web.get("/metrics", handler)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    logger.info(f"serving metrics on :{port}/metrics")
    return runner

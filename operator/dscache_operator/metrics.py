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
from collections.abc import Iterable, Iterator
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
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dscache_contract import StageSummary

from .clock import parse_time
from .models import NodeState, Phase, VolumeMode
from .version import package_version

if TYPE_CHECKING:
    from .workloads import PodInfo

logger = logging.getLogger(__name__)

ADMISSION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: A stage takes from well under a second (warm) to hours (a cold multi-TB copy).
STAGE_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
ADMISSION_RESULTS = ("admitted", "refused", "error")
#: Outcomes of one wipe request to a node agent (agentclient.py, nodeplan.judge_wipe).
WIPE_RESULTS = ("succeeded", "kept", "busy", "failed")
STAGER_RESULTS = ("ok", "failed")
#: The reasons sourcecheck.py gives; others still count, they just start from nothing.
SOURCE_REASONS = ("Listed", "NoSuchBucket", "AccessDenied", "EndpointUnreachable", "SecretNotFound")


class _Inventory(Collector):
    """Gauges computed at scrape time from what the controller last saw (every phase and state present, at 0 if none)."""

    def __init__(self) -> None:
        #: cache (namespace, name) -> (phase, node states)
        self.caches: dict[tuple[str, str], tuple[str, list[str]]] = {}

    def collect(self) -> Iterator[Metric]:
        phases = GaugeMetricFamily("dscache_datasetcaches", "DatasetCaches by phase.", labels=["phase"])
        copies = GaugeMetricFamily("dscache_node_copies", "Node copies by state.", labels=["state"])
        by_phase = dict.fromkeys((p.value for p in Phase), 0)
        by_state = dict.fromkeys((s.value for s in NodeState), 0)
        for phase, states in self.caches.values():
            by_phase[phase] = by_phase.get(phase, 0) + 1
            for s in states:
                by_state[s] = by_state.get(s, 0) + 1
        for p, n in sorted(by_phase.items()):
            phases.add_metric([p], n)
        for s, n in sorted(by_state.items()):
            copies.add_metric([s], n)
        yield phases
        yield copies


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
        self.since = since or datetime.datetime.now(datetime.UTC)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Gauge(
            "dscache_build_info", "The running dscache version (always 1).", ["version", "python"], registry=r
        )
        self.build_info.labels(version or package_version(), platform.python_version()).set(1)

        self.inventory = _Inventory()
        if ctl is not None:
            r.register(self.inventory)
        self.source_checks = Counter("dscache_source_checks", "Source checks by reason.", ["reason"], registry=ctl)
        for reason in SOURCE_REASONS:
            self.source_checks.labels(reason)

        per_cache = ["namespace", "cache"]
        self.wipes = Counter(
            "dscache_wipes", "Wipe requests to node agents by outcome, per cache.", [*per_cache, "result"], registry=ctl
        )
        self.prestaged = Gauge(
            "dscache_prestaged_bytes",
            "Bytes of the current revision pre-staged on each node that holds it (spec.prestage), per cache.",
            [*per_cache, "node"],
            registry=ctl,
        )
        self.stager_runs = Counter(
            "dscache_stager_runs",
            "Stager (init container) runs by result, per cache; each run counted once.",
            [*per_cache, "result"],
            registry=ctl,
        )
        self.stage_seconds = Histogram(
            "dscache_stage_seconds",
            "Seconds one successful stager run took (its summary's seconds), per cache.",
            per_cache,
            buckets=STAGE_BUCKETS,
            registry=ctl,
        )
        self.staged_bytes = Counter(
            "dscache_staged_bytes",
            "Bytes successful stager runs copied from the bucket (summary fetched_bytes), per cache.",
            per_cache,
            registry=ctl,
        )
        self.reused_bytes = Counter(
            "dscache_reused_bytes",
            "Bytes successful stager runs found already on the node and did not copy "
            "(warm starts and resumed copies: summary bytes - fetched_bytes), per cache.",
            per_cache,
            registry=ctl,
        )
        self.bucket_bytes = Counter(
            "dscache_bucket_bytes",
            "Bytes successful stager runs fetched from the bucket itself (summary bucket_bytes), per cache.",
            per_cache,
            registry=ctl,
        )
        self.peer_bytes = Counter(
            "dscache_peer_bytes",
            "Bytes successful stager runs got from other nodes instead of the bucket (summary peer_bytes), per cache.",
            per_cache,
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

    def wipe(self, namespace: str, name: str, result: str) -> None:
        self.wipes.labels(namespace, name, result).inc()

    def set_cache(self, namespace: str, name: str, phase: str, states: Iterable[str]) -> None:
        key = (namespace, name)
        if key not in self.inventory.caches:
            for result in WIPE_RESULTS:
                self.wipes.labels(namespace, name, result)
            for result in STAGER_RESULTS:
                self.stager_runs.labels(namespace, name, result)
            self.stage_seconds.labels(namespace, name)
            for m in self._bytes_counters():
                m.labels(namespace, name)
        self.inventory.caches[key] = (str(phase), [str(s) for s in states])

    def _bytes_counters(self) -> tuple[Counter, ...]:
        return (self.staged_bytes, self.reused_bytes, self.bucket_bytes, self.peer_bytes)

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
        self.inventory.caches.pop(key, None)
        self._counted.pop(key, None)
        for result in WIPE_RESULTS:
            _remove(self.wipes, namespace, name, result)
        for result in STAGER_RESULTS:
            _remove(self.stager_runs, namespace, name, result)
        _remove(self.stage_seconds, namespace, name)
        for counter in self._bytes_counters():
            _remove(counter, namespace, name)

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
            self.stager_runs.labels(namespace, name, p.init).inc()
            if p.summary is not None:
                self._observe_summary(namespace, name, p.summary)
        # Forget the runs of pods gone from the view: the set stays as small as the view.
        counted &= present
        return new

    def _observe_summary(self, namespace: str, name: str, summary: StageSummary) -> None:
        self.stage_seconds.labels(namespace, name).observe(summary.seconds)
        self.staged_bytes.labels(namespace, name).inc(summary.fetched_bytes)
        self.reused_bytes.labels(namespace, name).inc(max(0, summary.bytes - summary.fetched_bytes))
        self.bucket_bytes.labels(namespace, name).inc(summary.bucket_bytes)
        self.peer_bytes.labels(namespace, name).inc(summary.peer_bytes)

    # --- webhook -------------------------------------------------------------------------

    def admission(self, mode: str, result: str, seconds: float) -> None:
        self.admission_seconds.observe(seconds)
        self.admission_reviews.labels(mode, result).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _remove(metric: Counter | Histogram | Gauge, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


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

"""The controller's per-cache Prometheus series, kept as one small array per cache.

prometheus_client keeps a child object per label set, each value behind its own
lock: the 30 per-cache series (wipes, stager runs, the stage-seconds histogram,
the byte counters) cost about 10 KiB per cache, 100 MiB at 10,000 caches. Here a
cache is one array of doubles (about 300 bytes) and its phase, and the metric
families are built when Prometheus scrapes. The inventory gauges
(``dscache_datasetcaches`` by phase, ``dscache_node_copies`` by state) are
counted from the same records.
"""

from __future__ import annotations

import array
import bisect
import enum
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..api.models import NodeState, Phase
from ..cluster.workloads import InitState


class WipeCount(enum.StrEnum):
    """The dscache_wipes ``result`` a wipe's answer is counted under."""

    SUCCEEDED = "succeeded"
    KEPT = "kept"
    BUSY = "busy"  # a stager held the cache's lock: asked again later
    FAILED = "failed"


#: A stage takes from well under a second (warm) to hours (a cold multi-TB copy).
STAGE_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
#: Outcomes of one wipe request to a node agent (nodeplan.judge_wipe).
WIPE_RESULTS = tuple(WipeCount)
STAGER_RESULTS = (InitState.OK.value, InitState.FAILED.value)  # a finished stager's
#: The byte counters, each (name, help).
BYTES = (
    ("staged", "Bytes successful stager runs copied from the bucket (summary fetched_bytes), per cache."),
    (
        "reused",
        "Bytes successful stager runs found already on the node and did not copy "
        "(warm starts and resumed copies: summary bytes - fetched_bytes), per cache.",
    ),
    ("bucket", "Bytes successful stager runs fetched from the bucket itself (summary bucket_bytes), per cache."),
    (
        "peer",
        "Bytes successful stager runs got from other nodes instead of the bucket (summary peer_bytes), per cache.",
    ),
)

# The layout of one cache's array.
_WIPES = 0
_RUNS = _WIPES + len(WIPE_RESULTS)
_BYTES = _RUNS + len(STAGER_RESULTS)
_BUCKETS = _BYTES + len(BYTES)  # one per bucket and +Inf, not cumulative
_SUM = _BUCKETS + len(STAGE_BUCKETS) + 1
_COUNT = _SUM + 1
_SIZE = _COUNT + 1

Key = tuple[str, str]


class _Cache:
    __slots__ = ("phase", "states", "values")

    def __init__(self) -> None:
        self.phase = ""
        self.states: tuple[str, ...] = ()
        self.values = array.array("d", bytes(8 * _SIZE))


class CacheSeries(Collector):
    def __init__(self) -> None:
        self.caches: dict[Key, _Cache] = {}

    def _get(self, key: Key) -> _Cache:
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = _Cache()
        return cache

    # --- what the controller reports -----------------------------------------------------

    def set(self, key: Key, phase: str, states: Iterable[str]) -> None:
        """The cache's phase and its node copies' states; its series exist (at 0) from now on."""
        cache = self._get(key)
        cache.phase, cache.states = str(phase), tuple(str(s) for s in states)

    def forget(self, key: Key) -> None:
        self.caches.pop(key, None)

    def wipe(self, key: Key, result: str) -> None:
        if result in WIPE_RESULTS:
            self._get(key).values[_WIPES + WIPE_RESULTS.index(result)] += 1

    def stager_run(self, key: Key, result: str) -> None:
        if result in STAGER_RESULTS:
            self._get(key).values[_RUNS + STAGER_RESULTS.index(result)] += 1

    def staged(self, key: Key, seconds: float, staged: int, reused: int, bucket: int, peer: int) -> None:
        v = self._get(key).values
        for i, n in enumerate((staged, reused, bucket, peer)):
            v[_BYTES + i] += n
        v[_BUCKETS + bisect.bisect_left(STAGE_BUCKETS, seconds)] += 1
        v[_SUM] += seconds
        v[_COUNT] += 1

    # --- what Prometheus reads -----------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        phases = GaugeMetricFamily("dscache_datasetcaches", "DatasetCaches by phase.", labels=["phase"])
        copies = GaugeMetricFamily("dscache_node_copies", "Node copies by state.", labels=["state"])
        per_cache = ["namespace", "cache"]
        wipes = CounterMetricFamily(
            "dscache_wipes", "Wipe requests to node agents by outcome, per cache.", labels=[*per_cache, "result"]
        )
        runs = CounterMetricFamily(
            "dscache_stager_runs",
            "Stager (init container) runs by result, per cache; each run counted once.",
            labels=[*per_cache, "result"],
        )
        byte_counters = [CounterMetricFamily(f"dscache_{name}_bytes", text, labels=per_cache) for name, text in BYTES]
        seconds = HistogramMetricFamily(
            "dscache_stage_seconds",
            "Seconds one successful stager run took (its summary's seconds), per cache.",
            labels=per_cache,
        )
        by_phase = dict.fromkeys((p.value for p in Phase), 0)
        by_state = dict.fromkeys((s.value for s in NodeState), 0)
        les = [str(float(b)) for b in STAGE_BUCKETS] + ["+Inf"]
        for (namespace, name), cache in sorted(self.caches.items()):
            by_phase[cache.phase] = by_phase.get(cache.phase, 0) + 1
            for s in cache.states:
                by_state[s] = by_state.get(s, 0) + 1
            v, labels = cache.values, [namespace, name]
            for i, wiped in enumerate(WIPE_RESULTS):
                wipes.add_metric([*labels, wiped], v[_WIPES + i])
            for i, result in enumerate(STAGER_RESULTS):
                runs.add_metric([*labels, result], v[_RUNS + i])
            for i, family in enumerate(byte_counters):
                family.add_metric(labels, v[_BYTES + i])
            cumulative, buckets = 0.0, []
            for i, le in enumerate(les):
                cumulative += v[_BUCKETS + i]
                buckets.append((le, cumulative))
            seconds.add_metric(labels, buckets, v[_SUM])
        for p, n in sorted(by_phase.items()):
            phases.add_metric([p], n)
        for s, n in sorted(by_state.items()):
            copies.add_metric([s], n)
        yield phases
        yield copies
        yield wipes
        yield runs
        yield from byte_counters
        yield seconds

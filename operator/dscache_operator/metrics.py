"""Prometheus metrics in the text exposition format, without a client library.

Served on ``DSCACHE_METRICS_PORT`` at ``/metrics`` by both processes:
- controller: caches by phase, node copies by state, source checks and wipes;
- webhook: admission reviews by outcome and their latency.
"""

from __future__ import annotations

import bisect
import collections
import logging
from collections.abc import Iterable

from aiohttp import web

logger = logging.getLogger(__name__)

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.help: dict[str, str] = {}
        #: cache (namespace, name) -> (phase, {node state: count})
        self.caches: dict[tuple[str, str], tuple[str, dict[str, int]]] = {}
        self.hist_counts = [0] * (len(_BUCKETS) + 1)
        self.hist_sum = 0.0

    def inc(self, name: str, help_: str, **labels: str) -> None:
        self.help[name] = help_
        self.counters[name][tuple(sorted(labels.items()))] += 1

    def observe_admission(self, seconds: float) -> None:
        self.hist_counts[bisect.bisect_left(_BUCKETS, seconds)] += 1
        self.hist_sum += seconds

    def set_cache(self, namespace: str, name: str, phase: str, states: Iterable[str]) -> None:
        self.caches[(namespace, name)] = (phase, collections.Counter(states))

    def forget_cache(self, namespace: str, name: str) -> None:
        self.caches.pop((namespace, name), None)

    def render(self) -> str:
        out: list[str] = []

        def labels(pairs: Iterable[tuple[str, str]]) -> str:
            body = ",".join(f'{k}="{v}"' for k, v in pairs)
            return "{" + body + "}" if body else ""

        for name, series in sorted(self.counters.items()):
            out += [f"# HELP {name} {self.help.get(name, name)}", f"# TYPE {name} counter"]
            out += [f"{name}{labels(k)} {v}" for k, v in sorted(series.items())]
        if self.caches:
            phases = collections.Counter(p for p, _ in self.caches.values())
            out += ["# HELP dscache_datasetcaches DatasetCaches by phase.", "# TYPE dscache_datasetcaches gauge"]
            out += [f'dscache_datasetcaches{{phase="{p}"}} {n}' for p, n in sorted(phases.items())]
            states: collections.Counter = collections.Counter()
            for _, s in self.caches.values():
                states.update(s)
            out += ["# HELP dscache_node_copies Node copies by state.", "# TYPE dscache_node_copies gauge"]
            out += [f'dscache_node_copies{{state="{s}"}} {n}' for s, n in sorted(states.items())]
        if any(self.hist_counts):
            out += [
                "# HELP dscache_admission_seconds Time to answer an AdmissionReview.",
                "# TYPE dscache_admission_seconds histogram",
            ]
            acc = 0
            for bound, count in zip(_BUCKETS, self.hist_counts):
                acc += count
                out.append(f'dscache_admission_seconds_bucket{{le="{bound}"}} {acc}')
            out.append(f'dscache_admission_seconds_bucket{{le="+Inf"}} {sum(self.hist_counts)}')
            out.append(f"dscache_admission_seconds_sum {self.hist_sum}")
            out.append(f"dscache_admission_seconds_count {sum(self.hist_counts)}")
        return "\n".join(out) + "\n"


METRICS = Metrics()


async def serve(port: int) -> web.AppRunner | None:
    if not port:
        return None

    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=METRICS.render(), content_type="text/plain")

    app = web.Application()
    app.add_routes([web.get("/metrics", handler)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    logger.info(f"serving metrics on :{port}/metrics")
    return runner

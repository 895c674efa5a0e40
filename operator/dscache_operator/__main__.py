"""Entry points (one image, two long-running roles and two commands):

python -m dscache_operator controller   # reconcile DatasetCaches, track consumers, wipe
python -m dscache_operator webhook      # serve the mutating admission webhook (TLS)
python -m dscache_operator crdgen       # print the CRD generated from the models
python -m dscache_operator uninstall    # the chart's pre-delete hook: delete every DatasetCache, wait for the wipes
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys


def limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread its own malloc arena; with the source-check
    threads that bloats RSS by 100+ MiB for nothing. Same as MALLOC_ARENA_MAX."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def debug_memory_on_signal() -> None:
    """DSCACHE_DEBUG_MEMORY=1: SIGUSR2 logs the top allocations (tracemalloc)."""
    import signal
    import tracemalloc

    tracemalloc.start(12)

    def dump(*_: object) -> None:
        snap = tracemalloc.take_snapshot()
        log = logging.getLogger("dscache.memory")
        log.warning(f"{sum(s.size for s in snap.statistics('filename')) / 2**20:.1f} MiB traced in all")
        for stat in snap.statistics("traceback")[:15]:
            # The frames that say whose memory it is: ours and the libraries', not json's or asyncio's own.
            frames = [f for f in stat.traceback if "/json/" not in f.filename and "importlib" not in f.filename]
            lines = [f"  {f.filename}:{f.lineno}" for f in frames[-6:]]
            log.warning(f"{stat.size / 2**20:.1f} MiB in {stat.count} blocks:\n" + "\n".join(lines))

    signal.signal(signal.SIGUSR2, dump)


def configure_logging(level: str, fmt: str) -> None:
    """kopf's own log setup (what ``kopf run --log-format json`` does), then our level.
    JSON: one object per line with kopf's fields (and the object's namespace/name
    under ``object`` for per-object messages), for Loki/Elasticsearch without parsing."""
    import kopf

    kopf.configure(
        debug=level == "DEBUG",
        log_format=kopf.LogFormat.JSON if fmt == "json" else kopf.LogFormat.FULL,
        log_refkey="object" if fmt == "json" else None,
    )
    logging.getLogger().setLevel(level)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    role = argv[0] if argv else ""
    if role == "crdgen":
        from .api import crdgen

        crdgen.main()
        return 0
    if role == "uninstall":
        from .control import uninstall

        return uninstall.main(argv[1:])
    if role not in ("controller", "webhook"):
        print(__doc__, file=sys.stderr)
        return 2

    limit_malloc_arenas()
    if os.environ.get("DSCACHE_DEBUG_MEMORY"):
        debug_memory_on_signal()
    import kopf

    from .context import Context, memo_for
    from .settings import Settings

    # The one place settings are read: everything else gets them through the Context.
    settings = Settings.from_env()
    from prometheus_client import disable_created_metrics

    from .metrics.registry import Metrics

    # No `*_created` series: every counter would carry a second, constant series for nothing.
    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
    if role == "controller":
        from .control.state import ControlContext

        ctx: Context = ControlContext(settings=settings, metrics=Metrics(role=role))
    else:
        ctx = Context(settings=settings, metrics=Metrics(role=role))
    configure_logging(settings.log_level, settings.log_format)
    if role == "controller":
        from .control.reconcile import make_registry
    else:
        from .admission.webhook import make_registry
    namespaces = list(settings.watch_namespaces)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    kopf.run(
        registry=make_registry(settings),
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
        memo=memo_for(ctx),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

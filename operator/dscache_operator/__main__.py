"""Entry points (one image, two long-running roles and two commands):

python -m dscache_operator controller   # reconcile DatasetCaches, track consumers, wipe
python -m dscache_operator webhook      # serve the mutating admission webhook (TLS)
python -m dscache_operator crdgen       # print the CRD generated from the models
python -m dscache_operator uninstall    # the chart's pre-delete hook: delete every DatasetCache, wait for the wipes
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .context import Context

#: How long SIGTERM's first step (the controller's Lease release) may take before kopf's
#: shutdown starts anyway: well inside the pod's terminationGracePeriodSeconds.
HANDOVER_TIMEOUT = 5.0


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


async def operate(ctx: Context, **kopf_args: Any) -> None:
    """``kopf.operator()``, but SIGTERM and SIGINT first run ``ctx.before_stop()`` (the
    controller stops acting and releases its Lease), and only then start kopf's shutdown.

    kopf's own handler ends the operator this way: the signal stops its root tasks (watchers,
    probes, the admission server), it waits for all of them to exit, stops its core tasks
    (up to 10 s each), and only then runs the ``on.cleanup`` handlers; the tasks we started
    (the Lease elector among them) are cancelled after that. A release in a cleanup handler
    therefore came seconds after SIGTERM, the elector renewing all along, and not at all if
    the kubelet's SIGKILL came first: the standby then waited out the whole lease.
    ``spawn_tasks`` installs kopf's signal handlers; ours replace them right after it.
    """
    import kopf

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    existing = asyncio.all_tasks()  # as kopf.operator(): not the operator's, never cancelled by it
    tasks = await kopf.spawn_tasks(stop_flag=stop, **kopf_args)
    handing_over: list[asyncio.Task[None]] = []

    async def hand_over(sig: signal.Signals) -> None:
        log = logging.getLogger("dscache")
        log.info(f"{sig.name}: handing over before stopping")
        try:
            await asyncio.wait_for(ctx.before_stop(), HANDOVER_TIMEOUT)
        except Exception as e:  # the shutdown goes on whatever happened: kopf's cleanup retries the release
            log.warning(f"handing over on {sig.name} failed: {e!r}")
        finally:
            stop.set()  # kopf's stop-flag: its shutdown starts now

    def on_signal(sig: signal.Signals) -> None:
        if handing_over:  # a second signal: stop without waiting for the handover
            stop.set()
            return
        handing_over.append(loop.create_task(hand_over(sig), name="dscache handover"))

    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread: kopf's (or no) handlers stay
        pass
    await kopf.run_tasks(tasks, ignored=existing)


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
    coro = operate(
        ctx,
        registry=make_registry(settings),
        standalone=True,
        clusterwide=not namespaces,
        namespaces=namespaces,
        liveness_endpoint=liveness,
        memo=memo_for(ctx),
    )
    try:
        asyncio.run(coro)
    except asyncio.CancelledError:  # as kopf.run()
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

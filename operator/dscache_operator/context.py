"""The process context and the kopf settings shared by the controller and the webhook.

``Context`` is built once in ``__main__`` (settings read there, never at
import time) and handed to kopf as ``memo.ctx``: kopf gives every handler the
memo, so all handlers share the one context. This module is the rooms' common
ground: it imports ``kube``, ``metrics`` and ``api``, never ``control`` or ``admission``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import kopf

from .api.models import FINALIZER, GROUP
from .kube.client import Kube, connection_info, kopf_session
from .metrics.registry import Metrics
from .settings import Settings


@dataclasses.dataclass
class Context:
    """What one operator process shares, whichever its role: settings, our API client, metrics.

    The controller's process holds a ``control.state.ControlContext``, this with what
    reconciliation keeps; the webhook's holds this alone."""

    settings: Settings
    kube: Kube | None = None
    #: This process's metrics, on a registry of their own (not prometheus_client's global one).
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    metrics_runner: Any = None
    background: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    async def before_stop(self) -> None:
        """What SIGTERM does first, before kopf's own shutdown starts (``__main__.operate``).
        Nothing for the webhook; the controller stops acting and releases its Lease."""

    def ensure_kube(self) -> Kube:
        """Our client, logging in by ourselves if kopf has not done so yet."""
        if self.kube is None:
            self.kube = Kube(connection_info())
        return self.kube

    def api(self) -> Kube:
        if self.kube is None:
            raise kopf.TemporaryError("not logged in yet", delay=1)
        return self.kube


def memo_for(ctx: Context) -> kopf.Memo:
    return kopf.Memo(ctx=ctx)


def ctx_of(memo: Any) -> Context:
    ctx: Context = memo.ctx
    return ctx


async def start_metrics(ctx: Context) -> None:
    from .metrics import registry as metrics

    if ctx.metrics_runner is None:
        ctx.metrics_runner = await metrics.serve(ctx.settings.metrics_port, ctx.metrics)


async def shutdown(ctx: Context) -> None:
    if ctx.metrics_runner is not None:
        await ctx.metrics_runner.cleanup()
    if ctx.kube is not None:
        await ctx.kube.close()


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    # Everything kopf persists lives under our own group, never kopf.zalando.org.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Only warnings/errors of handlers become Kubernetes Events; our own Events
    # are posted explicitly with kopf.event().
    settings.posting.level = logging.WARNING
    # Re-establish watches regularly; a stale watch must not hide a completed Job.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # Not kopf's managed webhook configuration: the chart ships our own.
    settings.admission.managed = None
    if logging.getLogger().level > logging.DEBUG:  # logging.level=DEBUG shows kopf's per-object chatter too
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("kopf.activities").setLevel(logging.WARNING)


async def login(ctx: Context, **kwargs: Any) -> kopf.AiohttpSession:
    """In-cluster service account first, then KUBECONFIG (as kopf does), served
    to kopf through a session with a bounded connection pool.

    kopf calls this again whenever its own session gets a 401 (a rotated
    service-account token): the credentials are read afresh each time, and our
    own client takes them too.
    """
    info = connection_info(**kwargs)
    if ctx.kube is None:
        ctx.kube = Kube(info)
    else:
        ctx.kube.use(info)
    # Watch streams: DatasetCaches (+ CRD discovery) per namespace, or cluster-wide.
    watches = 2 * max(1, len(ctx.settings.watch_namespaces)) + 2
    return kopf_session(info, watches)

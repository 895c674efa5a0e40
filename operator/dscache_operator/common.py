"""kopf settings shared by the controller and the webhook processes."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from .kube import Kube, connection_info, kopf_session
from .models import FINALIZER, GROUP
from .settings import Settings


class Runtime:
    """Process-wide state: the settings and our small API client."""

    settings: Settings = Settings.from_env()
    kube: Kube | None = None
    metrics_runner: Any = None


async def start_metrics() -> None:
    from . import metrics
    if Runtime.metrics_runner is None:
        Runtime.metrics_runner = await metrics.serve(Runtime.settings.metrics_port)


async def shutdown() -> None:
    if Runtime.metrics_runner is not None:
        await Runtime.metrics_runner.cleanup()
    if Runtime.kube is not None:
        await Runtime.kube.close()


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    # Everything kopf persists lives under our own group, never kopf.zalando.org.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Only warnings/errors of handlers become Kubernetes Events; our own Events
    # are posted explicitly with kopf.event().
    settings.posting.level = logging.WARNING
    # Re-establish watches regularly; a stale watch must not hide a completed Job.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # Not kopf's managed webhook configuration: the chart ships our own.
    settings.admission.managed = None
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("kopf.activities").setLevel(logging.WARNING)


async def login(**kwargs: Any) -> kopf.AiohttpSession:
    """In-cluster service account first, then KUBECONFIG (as kopf does), served
    to kopf through a session with a bounded connection pool."""
    info = connection_info(**kwargs)
    if Runtime.kube is None:
        Runtime.kube = Kube(info)
    # Watch streams: DatasetCaches (+ CRD discovery) per namespace, or cluster-wide.
    watches = 2 * max(1, len(Runtime.settings.watch_namespaces)) + 2
    return kopf_session(info, watches)


def ensure_kube() -> Kube:
    """Our client, logging in by ourselves if kopf has not done so yet."""
    if Runtime.kube is None:
        from .kube import connection_info
        Runtime.kube = Kube(connection_info())
    return Runtime.kube


def kube() -> Kube:
    if Runtime.kube is None:
        raise kopf.TemporaryError("not logged in yet", delay=1)
    return Runtime.kube

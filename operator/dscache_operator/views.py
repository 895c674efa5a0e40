"""The controller's read-only views of users' workloads (see informer.py).

- consumer pods (labelled ``dscache.io/consumer=true`` by the webhook) -> PodInfo by (namespace, cache);
- Jobs the webhook labelled -> finished? by (namespace, job).

The controller never writes users' objects; it only reads these views.
"""

from __future__ import annotations

from typing import Any, Callable

from .consumers import job_finished, pod_info, pod_key
from .informer import MultiInformer
from .kube import Kube
from .models import CONSUMER_LABEL


def _pod_extract(body: dict[str, Any]):
    key = pod_key(body)
    return (key, pod_info(body)) if key else None


def _job_extract(body: dict[str, Any]):
    meta = body.get("metadata") or {}
    return ((meta.get("namespace"), meta.get("name")), job_finished(body))


class Views:
    def __init__(self, kube: Kube, namespaces: tuple[str, ...]) -> None:
        selector = f"{CONSUMER_LABEL}=true"
        self.pods = MultiInformer(kube, "/api/v1", "pods", namespaces, selector, _pod_extract)
        self.jobs = MultiInformer(kube, "/apis/batch/v1", "jobs", namespaces, selector, _job_extract)

    def start(self) -> None:
        self.pods.start()
        self.jobs.start()

    async def stop(self) -> None:
        await self.pods.stop()
        await self.jobs.stop()

    def ready(self) -> bool:
        # Not bool(informer): an informer with no objects is falsy (len 0) yet ready.
        return self.pods.ready and self.jobs.ready

    def auth_failing_for(self) -> float:
        return max(self.pods.auth_failing_for(), self.jobs.auth_failing_for())

    def job_lookup(self, namespace: str) -> Callable[[str], bool | None]:
        def state(job: str) -> bool | None:
            values = self.jobs.get((namespace, job))
            return values[0] if values else None
        return state

"""The web identity a pod-identity cache's stager gets: its own pod's ServiceAccount's role.

A DatasetCache with ``spec.source.serviceAccountName`` has no keys for the stager. The
stager must read the bucket as its pod (the tenant's workload identity), not as the
cache's ServiceAccount nor as the operator: the webhook reads the role annotation of
the pod's own ServiceAccount and injection.py gives the stager a projected token of
that ServiceAccount and IRSA's variables (AWS_ROLE_ARN, AWS_WEB_IDENTITY_TOKEN_FILE, and
AWS_ENDPOINT_URL_STS when the chart names an STS).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dscache_contract import STAGER_CONTAINER_NAME

from ..api.models import ROLE_ARN_ANNOTATION, DatasetCacheSpec
from ..cluster.identity import role_arn
from ..kube.client import ApiError, Kube
from ..settings import Settings
from .injection import WEB_IDENTITY_VOLUME, WebIdentity


def pod_spec_of(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    if kind == "Job":
        return ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    return obj.get("spec") or {}


def injected(pod_spec: dict[str, Any]) -> bool:
    """The pod spec has our stager already (a Job's pod, from its injected template)."""
    return any(c.get("name") == STAGER_CONTAINER_NAME for c in pod_spec.get("initContainers") or []) or any(
        v.get("name") == WEB_IDENTITY_VOLUME for v in pod_spec.get("volumes") or []
    )


async def stager_identity(
    kube: Callable[[], Kube], settings: Settings, namespace: str, obj: dict[str, Any], kind: str, spec: DatasetCacheSpec
) -> tuple[WebIdentity | None, list[str]]:
    """(the stager's web identity or None, warnings for kubectl). None for caches with keys,
    and for pods injected already. ``kube``: the webhook's client, made only when needed."""
    if spec.source.secret_name or not spec.source.serviceAccountName:
        return None, []
    pod_spec = pod_spec_of(obj, kind)
    if injected(pod_spec):
        return None, []
    account = pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount") or "default"
    try:
        sa = await kube().get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}")
    except ApiError as e:
        if e.status != 403:
            raise
        sa, forbidden = None, True
    else:
        forbidden = False
    role = role_arn(sa) if sa is not None else None
    if role is None:
        why = (
            "the webhook may not read it"
            if forbidden
            else ("it does not exist" if sa is None else f"it has no annotation {ROLE_ARN_ANNOTATION}")
        )
        return None, [
            f"the stager reads the bucket with this pod's own identity, but ServiceAccount "
            f"{namespace}/{account} gives it none ({why}): annotate the pod's ServiceAccount with "
            f"{ROLE_ARN_ANNOTATION}, or run the pod as one that is (the stager falls back to the node's role)."
        ]
    return WebIdentity(role, settings.sts_audience, settings.sts_endpoint), []

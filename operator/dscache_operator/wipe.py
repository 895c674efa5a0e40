"""Wipe a node's copy with a short helper pod pinned to that node.

The precedent is local-path-provisioner's helper pods. The pod:
- has a deterministic name per (namespace, cache, node), so creating it twice
  is a no-op (HTTP 409) and a restarted operator finds the one in flight;
- is pinned with ``nodeName`` (no scheduler), tolerates every taint by default,
  and runs in the operator's namespace with no service account token;
- runs ``dscache-stage wipe <cacheRoot>/<ns>/<name> --root <cacheRoot>``,
  which never deletes outside cacheRoot and never follows symlinks;
- is deleted by the operator once it succeeded.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
from typing import Any

import kopf

from .consumers import fmt_time, parse_time
from .injection import stager_security_context
from .kube import Kube
from .metrics import METRICS
from .models import NodeState, NodeStatus, PodPhase, VolumeMode
from .settings import Settings

#: A helper pod that is still Pending after this long (unschedulable node, image
#: pull failing, node gone) is deleted with a Warning Event, and retried later.
PENDING_TIMEOUT = 120.0

WIPE_LABEL = "dscache.io/wipe"
APP_LABEL = "app.kubernetes.io/name"


def helper_name(namespace: str, name: str, node: str) -> str:
    digest = hashlib.sha256(f"{namespace}/{name}/{node}".encode()).hexdigest()[:20]
    return f"dscache-wipe-{digest}"


def helper_pod(namespace: str, name: str, node: str, settings: Settings) -> dict[str, Any]:
    pod_name = helper_name(namespace, name, node)
    root = settings.cache_root
    spec: dict[str, Any] = {
        "nodeName": node,
        "restartPolicy": "Never",
        "tolerations": [dict(t) for t in settings.wipe_tolerations],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
        "containers": [{
            "name": "wipe",
            "image": settings.stager_image,
            "imagePullPolicy": settings.stager_pull_policy,
            "command": ["dscache-stage"],
            "args": ["wipe", settings.cache_dir(namespace, name), "--root", root],
            "volumeMounts": [{"name": "cache-root", "mountPath": root}],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                          "limits": {"memory": "128Mi"}},
            # uid 0 owns the kubelet-created directories; no capability is needed.
            "securityContext": stager_security_context(VolumeMode.HOST_PATH),
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "volumes": [{"name": "cache-root", "hostPath": {"path": root, "type": "DirectoryOrCreate"}}],
    }
    if settings.wipe_priority_class:
        spec["priorityClassName"] = settings.wipe_priority_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "namespace": settings.namespace,
            "labels": {APP_LABEL: "dscache-wipe", WIPE_LABEL: pod_name[len("dscache-wipe-"):]},
            "annotations": {"dscache.io/wipe-for": f"{namespace}/{name}", "dscache.io/wipe-node": node},
        },
        "spec": spec,
    }


class WipeState(enum.Enum):
    ABSENT = "absent"
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


def helper_state(pod: dict[str, Any] | None) -> WipeState:
    if pod is None:
        return WipeState.ABSENT
    phase = (pod.get("status") or {}).get("phase")
    if phase == PodPhase.SUCCEEDED:
        return WipeState.SUCCEEDED
    if phase == PodPhase.FAILED:
        return WipeState.FAILED
    if phase in (None, PodPhase.PENDING):
        return WipeState.PENDING
    return WipeState.RUNNING


def helper_message(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("message"):
            return term["message"].strip()[:1000]
        if term:
            return f"exit code {term.get('exitCode')}"
    return (pod.get("status") or {}).get("message") or "unknown"


# --- the driver: one step of one node's wipe per reconciliation -------------------------

def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


async def drive(kube: Kube, settings: Settings, body: Any, namespace: str, name: str,
                entry: NodeStatus, newest_use: datetime.datetime | None, logger: Any,
                now: datetime.datetime | None = None) -> bool:
    """Drive one node's wipe one step; True once the copy is gone (entry updated)."""
    now = now or _now()
    pod_name = helper_name(namespace, name, entry.node)
    pod = await kube.get_pod(settings.namespace, pod_name)
    state = helper_state(pod)
    created = parse_time(((pod or {}).get("metadata") or {}).get("creationTimestamp"))
    if state is not WipeState.ABSENT and newest_use and created and newest_use > created:
        # A stager started after this helper was created: its result is stale.
        await kube.delete_pod(settings.namespace, pod_name)
        return False
    if state is WipeState.ABSENT:
        created_pod = await kube.create_pod(settings.namespace, helper_pod(namespace, name, entry.node, settings))
        if created_pod is not None:
            METRICS.inc("dscache_wipes_total", "Wipe helper pods by outcome.", result="started")
            logger.info(f"wiping the copy on node {entry.node} with pod {pod_name}")
            kopf.event(body, type="Normal", reason="Wiping",
                       message=f"wiping the copy on node {entry.node} (helper pod "
                               f"{settings.namespace}/{pod_name})")
        return False
    if state is WipeState.PENDING:
        if created and (now - created).total_seconds() > PENDING_TIMEOUT:
            # Never wait forever on a helper that cannot start: say why, and retry.
            why = (pod.get("status") or {}).get("message") or _waiting_reason(pod) or "not started"
            METRICS.inc("dscache_wipes_total", "Wipe helper pods by outcome.", result="timeout")
            kopf.event(body, type="Warning", reason="WipeStuck",
                       message=f"the wipe helper {settings.namespace}/{pod_name} on node {entry.node} "
                               f"was still Pending after {PENDING_TIMEOUT:.0f} s ({why}); deleted, "
                               f"will retry")
            entry.message = f"wipe helper stuck Pending: {why}"
            await kube.delete_pod(settings.namespace, pod_name)
        return False
    if state is WipeState.RUNNING:
        return False
    if state is WipeState.FAILED:
        msg = helper_message(pod)
        METRICS.inc("dscache_wipes_total", "Wipe helper pods by outcome.", result="failed")
        kopf.event(body, type="Warning", reason="WipeFailed",
                   message=f"wiping node {entry.node} failed: {msg}; retrying")
        entry.message = f"wipe failed: {msg}"
        await kube.delete_pod(settings.namespace, pod_name)
        return False
    # Succeeded.
    entry.state = NodeState.WIPED
    entry.wipedAt = fmt_time(created) if created else fmt_time(now)
    entry.message = None
    METRICS.inc("dscache_wipes_total", "Wipe helper pods by outcome.", result="succeeded")
    kopf.event(body, type="Normal", reason="Wiped", message=f"wiped the copy on node {entry.node}")
    await kube.delete_pod(settings.namespace, pod_name)
    return True


def _waiting_reason(pod: dict[str, Any]) -> str | None:
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return f"{waiting['reason']}: {waiting.get('message') or ''}".strip(": ")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"{cond.get('reason')}: {cond.get('message') or ''}".strip(": ")
    return None

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

import enum
import hashlib
from typing import Any

from .injection import stager_security_context
from .settings import Settings

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
            "securityContext": stager_security_context("HostPath"),
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
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


def helper_state(pod: dict[str, Any] | None) -> WipeState:
    if pod is None:
        return WipeState.ABSENT
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Succeeded":
        return WipeState.SUCCEEDED
    if phase == "Failed":
        return WipeState.FAILED
    return WipeState.RUNNING


def helper_message(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if term.get("message"):
            return term["message"].strip()[:1000]
        if term:
            return f"exit code {term.get('exitCode')}"
    return (pod.get("status") or {}).get("message") or "unknown"

"""Wipe a node's copy with a short helper pod pinned to that node.

The precedent is local-path-provisioner's helper pods. The pod:
- has a deterministic name per (namespace, cache, node), so creating it twice
  is a no-op (HTTP 409) and a restarted operator finds the one in flight;
- is pinned with ``nodeName`` (no scheduler), tolerates every taint by default,
  and runs in the operator's namespace with no service account token;
- runs ``dscache-stage wipe C --root <cacheRoot> --revision R --release UIDs``
  (contract.WipeArgs): under the stagers' lock it deletes the leases of the
  pods the operator proved finished, then removes C/revs/R only if no lease
  remains (a lease the operator does not know = a pod it has not seen yet =
  keep). On DatasetCache deletion ``--all`` removes C once no lease at all
  remains. For the pseudo-revision LEGACY (a version 1 copy at the top of C)
  ``--legacy`` removes the top-level entries the current layout does not name.
  It never deletes outside cacheRoot and never follows symlinks;
- is deleted by the operator once it succeeded.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
from typing import Any

import kopf

import dscache_contract as contract

from .consumers import LEGACY, parse_time
from .injection import stager_security_context
from .kube import Kube
from .metrics import Metrics
from .models import NodeStatus, PodPhase, VolumeMode
from .settings import Settings

#: A helper pod that is still Pending after this long (unschedulable node, image
#: pull failing, node gone) is deleted with a Warning Event, and retried later.
PENDING_TIMEOUT = 120.0

WIPE_LABEL = "dscache.io/wipe"
APP_LABEL = "app.kubernetes.io/name"


def helper_name(namespace: str, name: str, node: str, revision: str | None = None) -> str:
    """Deterministic per (namespace, cache, node, revision); revision None = the whole cache dir."""
    digest = hashlib.sha256(f"{namespace}/{name}/{node}/{revision or '*'}".encode()).hexdigest()[:20]
    return f"dscache-wipe-{digest}"


def helper_args(
    namespace: str, name: str, settings: Settings, revision: str | None, release: tuple[str, ...] = ()
) -> list[str]:
    legacy = revision == LEGACY
    return contract.WipeArgs(
        cache_dir=settings.cache_dir(namespace, name),
        root=settings.cache_root,
        revision=None if legacy else revision,
        all_revisions=revision is None,
        release=() if legacy else tuple(release),
        termination_log=contract.TERMINATION_LOG,
        legacy=legacy,
    ).to_argv()


def helper_pod(
    namespace: str, name: str, node: str, settings: Settings, revision: str | None = None, release: tuple[str, ...] = ()
) -> dict[str, Any]:
    pod_name = helper_name(namespace, name, node, revision)
    root = settings.cache_root
    spec: dict[str, Any] = {
        "nodeName": node,
        "restartPolicy": "Never",
        "tolerations": [dict(t) for t in settings.wipe_tolerations],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
        "containers": [
            {
                "name": "wipe",
                "image": settings.stager_image,
                "imagePullPolicy": settings.stager_pull_policy,
                "command": ["dscache-stage"],
                "args": helper_args(namespace, name, settings, revision, release),
                "volumeMounts": [{"name": "cache-root", "mountPath": root}],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
                # uid 0 owns the kubelet-created directories; no capability is needed.
                "securityContext": stager_security_context(VolumeMode.HOST_PATH),
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": [{"name": "cache-root", "hostPath": {"path": root, "type": "DirectoryOrCreate"}}],
    }
    if settings.wipe_priority_class:
        spec["priorityClassName"] = settings.wipe_priority_class
    if settings.image_pull_secrets:  # the chart's imagePullSecrets: helpers run in the operator's namespace
        spec["imagePullSecrets"] = [{"name": n} for n in settings.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "namespace": settings.namespace,
            "labels": {APP_LABEL: "dscache-wipe", WIPE_LABEL: pod_name[len("dscache-wipe-") :]},
            "annotations": {
                "dscache.io/wipe-for": f"{namespace}/{name}",
                "dscache.io/wipe-node": node,
                "dscache.io/wipe-revision": revision or "*",
            },
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
            return str(term["message"]).strip()[:1000]
        if term:
            return f"exit code {term.get('exitCode')}"
    return (pod.get("status") or {}).get("message") or "unknown"


# --- the driver: one step of one node's wipe per reconciliation -------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Outcome(enum.Enum):
    IN_PROGRESS = "in-progress"
    REMOVED = "removed"  # gone (or it was never there)
    KEPT = "kept"  # leases the operator did not release still hold it


async def drive(
    kube: Kube,
    settings: Settings,
    metrics: Metrics,
    body: Any,
    namespace: str,
    name: str,
    entry: NodeStatus,
    step: Any,
    newest_use: datetime.datetime | None,
    logger: Any,
    now: datetime.datetime | None = None,
) -> tuple[Outcome, list[str]]:
    """Drive one (node, revision) wipe one step. ``step`` is a consumers.Release.
    Returns the outcome and, when KEPT, the pod UIDs whose leases kept it."""
    now = now or _now()
    revision, release = step.revision, tuple(step.release)
    what = (
        "the copy that predates revisions"
        if revision == LEGACY
        else f"revision {revision}"
        if revision
        else "the whole cache dir"
    )
    pod_name = helper_name(namespace, name, entry.node, revision)
    pod = await kube.get_pod(settings.namespace, pod_name)
    state = helper_state(pod)
    created = parse_time(((pod or {}).get("metadata") or {}).get("creationTimestamp"))
    if state is not WipeState.ABSENT and newest_use and created and newest_use > created:
        # A stager started after this helper was created: its result is stale.
        await kube.delete_pod(settings.namespace, pod_name)
        return Outcome.IN_PROGRESS, []
    if state is WipeState.ABSENT:
        created_pod = await kube.create_pod(
            settings.namespace, helper_pod(namespace, name, entry.node, settings, revision, release)
        )
        if created_pod is not None:
            metrics.wipe(namespace, name, "started")
            logger.info(f"wiping {what} on node {entry.node} with pod {pod_name}")
            kopf.event(
                body,
                type="Normal",
                reason="Wiping",
                message=f"wiping {what} on node {entry.node} (helper pod "
                f"{settings.namespace}/{pod_name}, releasing {len(release)} lease(s))",
            )
        return Outcome.IN_PROGRESS, []
    assert pod is not None  # helper_state(None) is ABSENT
    if state is WipeState.PENDING:
        if created and (now - created).total_seconds() > PENDING_TIMEOUT:
            # Never wait forever on a helper that cannot start: say why, and retry.
            why = (pod.get("status") or {}).get("message") or _waiting_reason(pod) or "not started"
            metrics.wipe(namespace, name, "timeout")
            kopf.event(
                body,
                type="Warning",
                reason="WipeStuck",
                message=f"the wipe helper {settings.namespace}/{pod_name} on node {entry.node} "
                f"was still Pending after {PENDING_TIMEOUT:.0f} s ({why}); deleted, "
                f"will retry",
            )
            entry.message = f"wipe helper stuck Pending: {why}"
            await kube.delete_pod(settings.namespace, pod_name)
        return Outcome.IN_PROGRESS, []
    if state is WipeState.RUNNING:
        return Outcome.IN_PROGRESS, []
    if state is WipeState.FAILED:
        msg = helper_message(pod)
        busy = _exit_code(pod) == int(contract.ExitCode.BUSY)
        metrics.wipe(namespace, name, "busy" if busy else "failed")
        if not busy:  # busy: a stager holds the lock right now; simply try again
            kopf.event(
                body,
                type="Warning",
                reason="WipeFailed",
                message=f"wiping {what} on node {entry.node} failed: {msg}; retrying",
            )
            entry.message = f"wipe failed: {msg}"
        await kube.delete_pod(settings.namespace, pod_name)
        return Outcome.IN_PROGRESS, []
    # Succeeded: removed, or kept by leases we did not release.
    summary = _wipe_summary(pod)
    await kube.delete_pod(settings.namespace, pod_name)
    if summary is not None and summary.existed and not summary.removed:
        metrics.wipe(namespace, name, "kept")
        uids = lease_uids(summary.leases)
        why = []
        if uids:
            why.append(f"lease(s) of pod(s) {', '.join(uids[:5])}{' ...' if len(uids) > 5 else ''} remain")
        if summary.stray:
            # Not a pod's lease, so no pod's end will release it: say where it is.
            why.append(
                f"{len(summary.stray)} entry(ies) under {summary.cache} that are no lease: "
                f"{', '.join(summary.stray[:5])}{' ...' if len(summary.stray) > 5 else ''} (remove them by hand)"
            )
        if summary.truncated:
            why.append("more not listed (the helper's report was cut to fit its termination message)")
        entry.message = f"{what} kept: {'; '.join(why) or 'no reason given'}"[:4096]
        return Outcome.KEPT, uids
    metrics.wipe(namespace, name, "succeeded")
    kopf.event(body, type="Normal", reason="Wiped", message=f"wiped {what} on node {entry.node}")
    entry.message = None
    return Outcome.REMOVED, []


def lease_uids(leases: list[str]) -> list[str]:
    """The pod UIDs a wipe reported, checked: they go back as --release, which
    WipeArgs accepts only as plain UIDs (the stager reports them so; anything
    else, such as a newer or broken helper, is left out rather than fail the
    helper pod we would build from it)."""
    out = set()
    for uid in leases:
        try:
            out.add(contract.validate_pod_uid(uid))
        except ValueError:
            continue
    return sorted(out)


def _exit_code(pod: dict[str, Any]) -> int | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if "exitCode" in term:
            return int(term["exitCode"])
    return None


def _wipe_summary(pod: dict[str, Any]) -> contract.WipeSummary | None:
    from .consumers import termination_summary

    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        data = termination_summary(((cs.get("state") or {}).get("terminated") or {}).get("message"))
        if data:
            return contract.WipeSummary.from_dict(data)
    return None


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

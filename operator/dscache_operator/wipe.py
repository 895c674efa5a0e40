"""Wipe a node's copy through that node's agent (``dscache-node``).

The controller decides (consumers.plan_nodes: which revision, which leases to
release); the node's agent carries it out with the stager's own wipe, under the
stagers' flock: it deletes the leases of the pods the controller proved
finished, then removes the revision only if no lease remains (a lease the
controller does not know = a pod it has not seen yet = keep), taking its warm
label off the Node first. One HTTP call, answered when it is done: no helper
pod to schedule, poll and delete, and a restarted controller simply asks again.
"""

from __future__ import annotations

import enum
import json
import logging
from typing import Any

import aiohttp

import dscache_contract as contract

from .consumers import LEGACY, Release
from .metrics import Metrics
from .models import NodeStatus
from .nodes import NodeInfo
from .settings import Settings

logger = logging.getLogger(__name__)

TIMEOUT_S = 60.0  # removing a large tree takes a while


class Outcome(enum.Enum):
    IN_PROGRESS = "in-progress"  # not done this time (busy, or the agent could not be asked): asked again later
    REMOVED = "removed"  # gone (or it was never there)
    KEPT = "kept"  # leases the controller did not release still hold it


class AgentError(Exception):
    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


def request_for(namespace: str, name: str, step: Release) -> contract.WipeRequest:
    legacy = step.revision == LEGACY
    return contract.WipeRequest(
        namespace=namespace,
        cache=name,
        revision=None if legacy else step.revision,
        all_revisions=step.revision is None,
        legacy=legacy,
        release=() if legacy else tuple(step.release),
    )


def agent_url(node: NodeInfo, settings: Settings) -> str | None:
    """The agent's address: its node's InternalIP (host network), and the port its label names."""
    if not node.agent or not node.address:
        return None
    port = node.agent_port or settings.agent_port
    host = f"[{node.address}]" if ":" in node.address else node.address
    return f"http://{host}:{port}"


async def call_agent(url: str, token: str | None, req: contract.WipeRequest) -> contract.WipeSummary:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session,
            session.post(url + contract.WIPE_PATH, data=req.to_json(), headers=headers) as resp,
        ):
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise AgentError(f"the node agent at {url} did not answer ({e or type(e).__name__})") from e
    if resp.status == 409:
        raise AgentError(text, busy=True)
    if resp.status != 200:
        raise AgentError(f"the node agent at {url} answered HTTP {resp.status}: {text[:500]}")
    return contract.WipeSummary.from_dict(json.loads(text))


def read_token(settings: Settings) -> str | None:
    if not settings.agent_token_file:
        return None
    try:
        with open(settings.agent_token_file) as f:
            return f.read().strip() or None
    except OSError:
        return None


def describe(step: Release) -> str:
    if step.revision == LEGACY:
        return "the copy that predates revisions"
    return f"revision {step.revision}" if step.revision else "the whole cache dir"


async def drive(
    settings: Settings, metrics: Metrics, out: Any, entry: NodeStatus, step: Release, node: NodeInfo | None
) -> tuple[Outcome, list[str]]:
    """One wipe on one node. Returns the outcome and, when KEPT, the pod UIDs whose leases kept it."""
    namespace, name = out.view.key
    what = describe(step)
    url = agent_url(node, settings) if node is not None else None
    if url is None:
        message = (
            f"no dscache-node agent runs on node {entry.node}: {what} cannot be wiped until one does "
            f"(check the chart's nodeAgent.nodeSelector and tolerations, and kubectl get pods -n "
            f"{settings.namespace} -l app.kubernetes.io/name=dscache-node)"
        )
        _fail(out, metrics, entry, message)
        return Outcome.IN_PROGRESS, []
    try:
        summary = await call_agent(url, read_token(settings), request_for(namespace, name, step))
    except AgentError as e:
        if e.busy:  # a stager holds the cache's lock right now: simply try again
            metrics.wipe(namespace, name, "busy")
        else:
            _fail(out, metrics, entry, f"wiping {what} on node {entry.node} failed: {e}")
        return Outcome.IN_PROGRESS, []
    if summary.existed and not summary.removed:
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
        entry.message = f"{what} kept: {'; '.join(why) or 'no reason given'}"[:4096]
        return Outcome.KEPT, uids
    metrics.wipe(namespace, name, "succeeded")
    logger.info(f"{namespace}/{name}: wiped {what} on node {entry.node}")
    out.event("Normal", "Wiped", f"wiped {what} on node {entry.node}")
    entry.message = None
    return Outcome.REMOVED, []


def _fail(out: Any, metrics: Metrics, entry: NodeStatus, message: str) -> None:
    namespace, name = out.view.key
    metrics.wipe(namespace, name, "failed")
    if entry.message != message:  # one Event per new reason, not one per reconciliation
        out.event("Warning", "WipeFailed", f"{message}; retrying")
    entry.message = message[:4096]


def lease_uids(leases: list[str]) -> list[str]:
    """The pod UIDs a wipe reported, checked: they go back as ``release``, which
    WipeRequest accepts only as plain UIDs (anything else is left out)."""
    out = set()
    for uid in leases:
        try:
            out.add(contract.validate_pod_uid(uid))
        except ValueError:
            continue
    return sorted(out)

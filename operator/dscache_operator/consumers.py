"""Who uses which cache on which node, and what each node's copy is: pure logic.

The controller keeps two read-only views (informer.py; it never writes to
users' objects):
- pods carrying ``dscache.io/cache`` -> ``PodInfo`` by (namespace, cache);
- Jobs the webhook labelled -> finished? by (namespace, job).

``reconcile_nodes`` turns those plus the previous ``status.nodes`` into the
new node entries and the set of nodes whose copy must be wiped. It is
level-based: it depends only on the current state, so an operator restart
converges to the same answer.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Callable, Iterable, NamedTuple

from .injection import INIT_NAME, MODE_ANNOTATION
from .models import (CACHE_ANNOTATION, NodeState, NodeStatus, PodPhase, Retention, RetentionPolicy,
                     VolumeMode, parse_duration)


class PodInfo(NamedTuple):
    name: str
    node: str | None
    phase: str
    job: str | None          # owning Job's name, if any
    mode: str                # HostPath | EmptyDir
    init: str | None         # None (not injected/seen), waiting, running, ok, failed
    started: str | None      # init container start (RFC 3339)
    message: str | None      # init container termination message


def _owner_job(meta: dict[str, Any]) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "Job" and str(ref.get("apiVersion", "")).startswith("batch/"):
            return ref.get("name")
    return None


def pod_info(body: dict[str, Any]) -> PodInfo:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    init = started = message = None
    for cs in status.get("initContainerStatuses") or []:
        if cs.get("name") != INIT_NAME:
            continue
        state = cs.get("state") or {}
        if "terminated" in state:
            t = state["terminated"]
            init = "ok" if t.get("exitCode") == 0 else "failed"
            started, message = t.get("startedAt"), t.get("message")
        elif "running" in state:
            init, started = "running", state["running"].get("startedAt")
        else:
            init = "waiting"
            last = (cs.get("lastState") or {}).get("terminated")
            if last:  # restarting after a failure (restartPolicy OnFailure)
                init, started, message = "failed", last.get("startedAt"), last.get("message")
    annotations = meta.get("annotations") or {}
    return PodInfo(
        name=meta.get("name", ""),
        node=spec.get("nodeName") or None,
        phase=status.get("phase") or PodPhase.PENDING,
        job=_owner_job(meta),
        mode=annotations.get(MODE_ANNOTATION, VolumeMode.HOST_PATH),
        init=init, started=started, message=(message or "").strip() or None,
    )


def pod_key(body: dict[str, Any]) -> tuple[str, str] | None:
    meta = body.get("metadata") or {}
    cache = (meta.get("annotations") or {}).get(CACHE_ANNOTATION)
    if not cache:
        return None
    return (meta.get("namespace", ""), cache)


def job_finished(body: dict[str, Any]) -> bool:
    for cond in (body.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return True
    return False


def is_consumer(pod: PodInfo, job_state: Callable[[str], bool | None]) -> bool:
    """A pod still needs its node's copy.

    A running (or pending) pod does. A finished pod does while its Job is
    known and not finished yet (the Job may start another pod there).
    """
    if pod.phase not in (PodPhase.SUCCEEDED, PodPhase.FAILED):
        return True
    if pod.job is not None:
        return job_state(pod.job) is False
    return False


def parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def fmt_time(t: datetime.datetime) -> str:
    return t.astimezone(datetime.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def termination_summary(message: str | None) -> dict[str, Any]:
    """The stager's JSON summary, if the message is one."""
    if not message:
        return {}
    for line in reversed(message.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
                return data if isinstance(data, dict) else {}
            except ValueError:
                return {}
    return {}


class NodePlan(NamedTuple):
    entry: NodeStatus
    wipe: bool            # the node's host copy must be wiped now
    relevant_since: datetime.datetime | None  # newest init start among relevant pods


def _started_after(pod: PodInfo, wiped_at: datetime.datetime | None) -> bool:
    started = parse_time(pod.started)
    if started is None:
        return False
    return wiped_at is None or started >= wiped_at


def plan_node(node: str, prior: NodeStatus | None, pods: Iterable[PodInfo],
              job_state: Callable[[str], bool | None], retention: Retention,
              now: datetime.datetime, deleting: bool = False) -> NodePlan | None:
    pods = list(pods)
    wiped_at = parse_time(prior.wipedAt) if prior is not None else None
    consumers = [p for p in pods if is_consumer(p, job_state)]
    relevant = [p for p in pods if p in consumers or _started_after(p, wiped_at)]
    if prior is None and not relevant:
        return None  # only old, finished pods: nothing of theirs is on the node any more
    entry = (prior.model_copy(deep=True) if prior is not None
             else NodeStatus(node=node, state=NodeState.STAGING))

    if relevant:
        if any(p.mode == VolumeMode.HOST_PATH for p in relevant):
            entry.volume = VolumeMode.HOST_PATH
        else:
            entry.volume = VolumeMode.EMPTY_DIR
        ok = [p for p in relevant if p.init == "ok"]
        failed = [p for p in relevant if p.init == "failed"]
        pending = [p for p in consumers if p.init in (None, "waiting", "running")]
        if ok:
            best = max(ok, key=lambda p: p.started or "")
            summary = termination_summary(best.message)
            entry.state, entry.message = NodeState.READY, None
            for field in ("bytes", "objects", "seconds"):
                if isinstance(summary.get(field), (int, float)):
                    setattr(entry, field, summary[field])
        elif pending:
            entry.state, entry.message = NodeState.STAGING, None
        elif failed:
            last = max(failed, key=lambda p: p.started or "")
            entry.state = NodeState.FAILED
            entry.message = (last.message or "the stager failed; see kubectl logs -c " + INIT_NAME)[:4096]

    if len(consumers) != entry.consumers or (prior is None and relevant):
        entry.lastUsed = fmt_time(now)
    entry.consumers = len(consumers)

    wipe = False
    holds_copy = entry.state != NodeState.WIPED and (prior is not None or bool(relevant))
    if holds_copy and not consumers:
        if deleting or retention.policy == RetentionPolicy.WIPE_ON_JOB_COMPLETION:
            wipe = True
        else:
            last = parse_time(entry.lastUsed) or now
            ttl = parse_duration(retention.ttlAfterLastUse or "0s")
            wipe = (now - last).total_seconds() >= ttl
    if wipe and entry.volume == VolumeMode.EMPTY_DIR:
        # The kubelet removes emptyDir volumes with their pods: nothing of ours remains.
        entry.state, entry.wipedAt, wipe = NodeState.WIPED, fmt_time(now), False
    newest = max((parse_time(p.started) for p in relevant if p.started), default=None)
    return NodePlan(entry, wipe, newest)


def plan_nodes(prior: list[NodeStatus], pods: Iterable[PodInfo],
               job_state: Callable[[str], bool | None], retention: Retention,
               now: datetime.datetime, deleting: bool = False,
               keep_wiped: float = 3600.0) -> dict[str, NodePlan]:
    by_node: dict[str, list[PodInfo]] = {}
    for p in pods:
        if p.node:
            by_node.setdefault(p.node, []).append(p)
    prior_by_node = {n.node: n for n in prior}
    plans = {}
    for node in sorted(set(by_node) | set(prior_by_node)):
        old = prior_by_node.get(node)
        if old is not None and node not in by_node and old.state == NodeState.WIPED:
            wiped = parse_time(old.wipedAt)
            if wiped is None or (now - wiped).total_seconds() > keep_wiped:
                continue  # keep status bounded: forget long-wiped nodes no pod refers to
        plan = plan_node(node, prior_by_node.get(node), by_node.get(node, []),
                         job_state, retention, now, deleting)
        if plan is not None:
            plans[node] = plan
    return plans

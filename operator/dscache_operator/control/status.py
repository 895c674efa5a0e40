"""Build DatasetCache status fragments (metav1.Condition semantics)."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from dscache_contract import RevisionRef, human_bytes
from dscache_contract.clock import fmt_time

from ..api.models import NodeState, NodeStatus
from ..cluster.caches import owner_pin_ref
from ..cluster.nodes import NodeInfo, warm_nodes

SOURCE_READY = "SourceReady"
READY = "Ready"
MAX_WARM_REVISIONS = 64


def set_condition(
    conditions: list[dict[str, Any]],
    *,
    type: str,
    status: str,
    reason: str,
    message: str,
    generation: int | None,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """Return a new list; lastTransitionTime only moves when status changes."""
    out = [dict(c) for c in conditions if c.get("type") != type]
    old = next((c for c in conditions if c.get("type") == type), None)
    transition = old.get("lastTransitionTime") if old and old.get("status") == status else fmt_time(now)
    cond = {"type": type, "status": status, "reason": reason, "message": message, "lastTransitionTime": transition}
    if generation is not None:
        cond["observedGeneration"] = generation
    out.append(cond)
    return out


def get_condition(status: dict[str, Any], type: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type), None)


def nodes_fragment(entries: list[NodeStatus]) -> dict[str, Any]:
    nodes = [e.model_dump(exclude_none=True) for e in sorted(entries, key=lambda e: e.node)]
    return {"nodes": nodes, "readyNodes": sum(1 for e in entries if e.state == NodeState.READY)}


def source_fragment(objects: int | None, nbytes: int | None) -> dict[str, Any]:
    return {"objects": objects, "bytes": nbytes, "size": human_bytes(nbytes) if nbytes is not None else None}


def changed(current: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``wanted`` that differ from ``current`` (a merge-patch for status)."""
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def revision_fragment(
    rev: RevisionRef, objects: int | None, nbytes: int | None, now: datetime.datetime
) -> dict[str, Any]:
    out = {"id": rev.id, "objects": objects or 0, "bytes": nbytes or 0, "listedAt": fmt_time(now)}
    # asOf only when set: status equal to the object's own must compare equal.
    return out | ({"versioned": True, "asOf": rev.as_of} if rev.versioned else {"versioned": False})


def owner_pins(pods: list[Any], owners: Any, prior: list[dict[str, Any]], limit: int = 500) -> list[dict[str, Any]]:
    """status.owners: every owner in a live consumer pod's ownerReferences chain ->
    the revision its pods stage, so the webhook gives that owner's new pods the
    same revision (a PyTorchJob recreating a worker after a refresh). Pins of
    owners with no live pod left are dropped; the first revision seen wins."""
    from ..cluster.workloads import holds

    old = {o.get("uid"): o for o in prior}
    pins: dict[str, dict[str, Any]] = {}
    for p in sorted(pods, key=lambda p: p.started or ""):
        if p.pinned is None or p.owner is None or not holds(p, owners):
            continue
        ref, seen = p.owner, set()
        while ref is not None and ref.uid not in seen and len(pins) < limit:
            seen.add(ref.uid)
            # An earlier pin wins, with its own as-of time (a revision and its time go together).
            rev = owner_pin_ref(old.get(ref.uid) or {}) or p.pinned
            pin = {"uid": ref.uid, "kind": ref.kind, "name": ref.name, "revision": rev.id}
            if rev.as_of is not None:  # a null in a list item would fail the schema
                pin["asOf"] = rev.as_of
            pins.setdefault(ref.uid, pin)
            info = owners(ref.uid)
            ref = info.owner if info is not None else None
    return [pins[k] for k in sorted(pins)]


def warm_fragment(
    namespace: str, name: str, revision: RevisionRef | None, entries: list[NodeStatus], nodes: Iterable[NodeInfo]
) -> list[dict[str, Any]]:
    """status.warm: per revision (the pinned one first), how many nodes' agents hold it complete."""
    ids = [revision.id] if revision is not None else []
    for e in entries:
        ids += [r.id for r in e.revisions if r.wipedAt is None and r.id.startswith("r-") and r.id not in ids]
    nodes = list(nodes)
    return [
        {"revision": rev, "nodes": len(warm_nodes(nodes, namespace, name, rev))} for rev in ids[:MAX_WARM_REVISIONS]
    ]


def ready_condition(
    source: dict[str, Any] | None, revision: RevisionRef | None, prestage: dict[str, Any] | None, deleting: bool
) -> dict[str, str]:
    """The Ready condition (kubectl wait --for=condition=Ready): the source is checked with a
    revision pinned and, with spec.prestage, every chosen node holds that revision."""
    if deleting:
        return _ready("False", "Deleting", "the DatasetCache is being deleted")
    if source is None or source.get("status") != "True":
        why = f"{source.get('reason')}: {source.get('message')}" if source else "the source has not been checked yet"
        return _ready("False", "SourceNotReady", f"the source is not ready ({why})")
    if revision is None:
        return _ready("False", "NoRevision", "no revision of the source is pinned yet")
    if prestage is not None:
        wanted, ready = prestage.get("wanted", 0), prestage.get("ready", 0)
        if wanted == 0:
            return _ready("False", "NoPrestageNodes", prestage.get("message") or "no node matches spec.prestage")
        if ready < wanted:
            more = f": {prestage['message']}" if prestage.get("message") else ""
            return _ready("False", "Prestaging", f"{ready} of {wanted} node(s) hold revision {revision.id}{more}")
        return _ready("True", "Prestaged", f"revision {revision.id} is on all {wanted} pre-stage node(s)")
    return _ready("True", "SourceReady", f"revision {revision.id} is pinned; pods stage it when they start")


def _ready(status: str, reason: str, message: str) -> dict[str, str]:
    return {"type": READY, "status": status, "reason": reason, "message": message}

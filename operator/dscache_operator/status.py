"""Build DatasetCache status fragments (metav1.Condition semantics)."""

from __future__ import annotations

import datetime
from typing import Any

from .consumers import fmt_time
from .models import NodeState, NodeStatus, human_bytes

SOURCE_READY = "SourceReady"


def set_condition(conditions: list[dict[str, Any]], *, type: str, status: str, reason: str,
                  message: str, generation: int | None, now: datetime.datetime) -> list[dict[str, Any]]:
    """Return a new list; lastTransitionTime only moves when status changes."""
    out = [dict(c) for c in conditions if c.get("type") != type]
    old = next((c for c in conditions if c.get("type") == type), None)
    transition = (old.get("lastTransitionTime") if old and old.get("status") == status
                  else fmt_time(now))
    cond = {"type": type, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": transition}
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
    return {"objects": objects, "bytes": nbytes, "size": human_bytes(nbytes)}


def changed(current: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``wanted`` that differ from ``current`` (a merge-patch for status)."""
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def revision_fragment(rev: str, objects: int | None, nbytes: int | None,
                      now: datetime.datetime) -> dict[str, Any]:
    return {"id": rev, "objects": objects or 0, "bytes": nbytes or 0, "listedAt": fmt_time(now),
            "versioned": False}

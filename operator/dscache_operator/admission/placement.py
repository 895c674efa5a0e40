"""Warm-node placement: what the webhook adds to a pod's node affinity (pure, no I/O).

A node agent labels its Node with ``warm_label(namespace, cache, revision)``
once it holds that revision complete and verified (dscache_contract.node).
The default scheduler does the placement from that label:

- Preferred (the default): one preferred term toward nodes that carry the
  label, with the chart's weight, added only when at least one node does (a
  term no node can match only costs the scheduler time);
- Required: the label becomes a condition of every required node selector
  term, so the pod waits Pending for a warm node instead of copying elsewhere.

A pod's own affinity, podAffinity and nodeSelector are kept and merged with
ours, never replaced. Every step is keyed by the label key, so a reinvocation
never adds a term twice.

The node index (kept by the webhook, one entry set per Node) holds only what
placement needs: the warm label keys (key -> node name) and the node's byte
budget (``BUDGET_KEY`` -> bytes), from the agent's inventory annotation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dscache_contract import (
    ANNOTATION_PLACEMENT,
    INVENTORY_ANNOTATION,
    VOLUME_NAME,
    WARM_LABEL_PREFIX,
    Inventory,
    csi,
    human_bytes,
)

from ..api.models import PlacementMode

#: The node index key under which each Node's budget (bytes) is stored; a tuple,
#: so it can never clash with a label key (a string).
BUDGET_KEY = ("budget",)
#: The chart value that sets the node agent's byte budget (named in warnings).
BUDGET_VALUE = "nodeAgent.budget"


class PlacementError(ValueError):
    """An invalid placement request; the message says what was wrong and how to fix it."""


# --- the node index ---------------------------------------------------------------


def inventory_budget(text: str | None) -> int | None:
    """The byte budget in a Node's inventory annotation (None: absent or unparsable).

    An agent mid-upgrade or a hand-edited annotation must not break admission:
    an unreadable inventory is the same as none."""
    if not text:
        return None
    try:
        budget = Inventory.from_json(text).budget
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    # bool is an int subclass; a budget of True bytes is garbage, not 1.
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        return None
    return budget


def node_entries(name: str, labels: Mapping[str, str], annotations: Mapping[str, str]) -> dict[Any, Any]:
    """One Node's entries in the webhook's node index: its warm label keys (-> its
    name) and its budget. Nothing else of the Node is kept (its status alone,
    with the image list, can be tens of KiB)."""
    entries: dict[Any, Any] = {key: name for key in labels if key.startswith(WARM_LABEL_PREFIX)}
    budget = inventory_budget(annotations.get(INVENTORY_ANNOTATION))
    if budget is not None:
        entries[BUDGET_KEY] = budget
    return entries


def warm_nodes(index: Mapping[Any, Iterable[Any]] | None, key: str) -> int:
    """How many nodes the index knows to carry the warm label ``key``."""
    store = index.get(key) if index is not None else None
    return len(set(store)) if store else 0


def largest_budget(index: Mapping[Any, Iterable[Any]] | None) -> int | None:
    """The largest byte budget of any node in the index (None: no node published one)."""
    store = index.get(BUDGET_KEY) if index is not None else None
    budgets = [b for b in store or () if isinstance(b, int)]
    return max(budgets) if budgets else None


# --- the mode ----------------------------------------------------------------------


def annotation_mode(annotations: Mapping[str, str]) -> PlacementMode | None:
    """The mode a pod (or a pod template) asks for with ANNOTATION_PLACEMENT, if any."""
    value = annotations.get(ANNOTATION_PLACEMENT)
    if value is None:
        return None
    for mode in PlacementMode:
        if str(value).strip().lower() == mode.value.lower():
            return mode
    raise PlacementError(
        f"annotation {ANNOTATION_PLACEMENT}={value!r} is not a placement mode: use "
        f"{PlacementMode.REQUIRED.value.lower()!r} (pods wait for a node that already holds the "
        f"dataset's revision) or {PlacementMode.PREFERRED.value.lower()!r} (the default: prefer such "
        f"a node, copy elsewhere if none fits), or remove the annotation."
    )


def carry_to_template(job_annotations: Mapping[str, str], template_meta: dict[str, Any]) -> bool:
    """Copy a Job's own ANNOTATION_PLACEMENT onto its pod template; True if copied.

    A Job opts in with the cache annotation on itself or its template, so users
    put the placement one beside it; only the template's reaches the pods. The
    template's own value wins. Validated first: a bad value is refused at the Job."""
    value = job_annotations.get(ANNOTATION_PLACEMENT)
    annotations = template_meta.get("annotations") or {}
    if value is None or ANNOTATION_PLACEMENT in annotations:
        return False
    annotation_mode(job_annotations)
    template_meta["annotations"] = {**annotations, ANNOTATION_PLACEMENT: value}
    return True


def effective_mode(cache_mode: PlacementMode, annotations: Mapping[str, str]) -> PlacementMode:
    """Required if the cache or the pod asks for it. A pod cannot relax a cache's
    Required: the cache's owner chose to never copy outside warm nodes."""
    asked = annotation_mode(annotations)
    if PlacementMode.REQUIRED in (cache_mode, asked):
        return PlacementMode.REQUIRED
    return PlacementMode.PREFERRED


def uses_node_copy(pod_spec: Mapping[str, Any]) -> bool:
    """Whether the pod's cache volume is the node's copy, a CSI volume of the agents' driver or
    a hostPath (warm labels describe only those; an emptyDir is the pod's own).

    Read from the injected volume rather than the endpoint's mode: a reinjected
    object keeps the mode it was first injected with (injection.inject_object)."""
    return any(
        v.get("name") == VOLUME_NAME and ("hostPath" in v or (v.get("csi") or {}).get("driver") == csi.DRIVER)
        for v in pod_spec.get("volumes") or []
    )


# --- the affinity --------------------------------------------------------------------


def exists(key: str) -> dict[str, Any]:
    """The node selector requirement ``key`` Exists (the label's value carries nothing)."""
    return {"key": key, "operator": "Exists"}


def _has(expressions: Iterable[Mapping[str, Any]], key: str) -> bool:
    return any(e.get("key") == key and e.get("operator") == "Exists" for e in expressions)


def _node_affinity(pod_spec: dict[str, Any]) -> dict[str, Any]:
    # `or {}` and write back: a null affinity from a client is as good as none.
    # (The API server has decoded the object into a typed Pod before admission,
    # so every field present has its schema's shape.)
    affinity = pod_spec.get("affinity") or {}
    pod_spec["affinity"] = affinity
    node_affinity = affinity.get("nodeAffinity") or {}
    affinity["nodeAffinity"] = node_affinity
    return node_affinity


def prefer(pod_spec: dict[str, Any], key: str, weight: int) -> bool:
    """Append a preferred term toward nodes labelled ``key``; True if added.

    Appended, never replacing: the scheduler sums the weights of every matching
    term, so the pod's own preferences still count as they did."""
    node_affinity = (pod_spec.get("affinity") or {}).get("nodeAffinity") or {}
    terms = node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    if any(_has((t.get("preference") or {}).get("matchExpressions") or [], key) for t in terms):
        return False
    node_affinity = _node_affinity(pod_spec)
    node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
        *terms,
        {"weight": weight, "preference": {"matchExpressions": [exists(key)]}},
    ]
    return True


def require(pod_spec: dict[str, Any], key: str) -> bool:
    """Make ``key`` Exists a condition of the pod's required node affinity; True if changed.

    nodeSelectorTerms are ORed, so the requirement goes into every term (a term
    without it would let the pod onto a cold node); with no term, one is created.
    The pod's own requirements stay in their terms (ANDed with ours)."""
    node_affinity = (pod_spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or []]
    changed = not terms
    for term in terms:
        expressions = term.get("matchExpressions") or []
        if not _has(expressions, key):
            term["matchExpressions"] = [*expressions, exists(key)]
            changed = True
    if not changed:
        return False
    _node_affinity(pod_spec)["requiredDuringSchedulingIgnoredDuringExecution"] = {
        **required,
        "nodeSelectorTerms": terms or [{"matchExpressions": [exists(key)]}],
    }
    return True


def place(pod_spec: dict[str, Any], key: str, mode: PlacementMode, warm: int, weight: int) -> bool:
    """Add our node affinity for ``mode``; True if the pod spec changed.

    Required applies even when no node is warm yet (``warm`` == 0): the pod
    waits for one rather than copying elsewhere. Preferred toward nothing is
    nothing: a term no node matches only costs the scheduler time."""
    if mode == PlacementMode.REQUIRED:
        return require(pod_spec, key)
    return prefer(pod_spec, key, weight) if warm else False


# --- warnings --------------------------------------------------------------------------


def capacity_warning(ref: str, revision: str, revision_bytes: int | None, budget: int | None) -> str | None:
    """A warning when no node's budget can hold the revision (None: it fits, or unknown)."""
    if revision_bytes is None or budget is None or revision_bytes <= budget:
        return None
    return (
        f"{ref}: revision {revision} holds {revision_bytes} bytes ({human_bytes(revision_bytes)}), more than "
        f"the largest node byte budget, {budget} bytes ({human_bytes(budget)}): no node can keep it, so its "
        f"pods will fail to stage. Raise the chart value {BUDGET_VALUE}, or narrow the cache with "
        f"spec.source.include/exclude."
    )


def cold_required_warning(ref: str, revision: str, by_cache: bool) -> str:
    """A warning when Required placement has no warm node yet (the pod is still admitted:
    pre-staging or another pod's copy will warm a node, and it is then scheduled)."""
    relax = (
        "set spec.placement.mode: Preferred on the DatasetCache"
        if by_cache
        else f"remove the annotation {ANNOTATION_PLACEMENT}"
    )
    why = "spec.placement.mode of the DatasetCache" if by_cache else f"annotation {ANNOTATION_PLACEMENT}"
    return (
        f"{ref}: placement is Required ({why}) and no node is known to hold revision {revision} yet: "
        f"its pods stay Pending until one does. spec.prestage on the DatasetCache stages it onto chosen "
        f"nodes ahead of any Job; to copy on any node instead, {relax}."
    )

"""What the controller knows of Nodes: their address, labels, taints, and what their agents hold.

A node agent (dscache-node) labels its Node with one warm label per complete,
verified revision it holds (contract.warm_label) and with contract.AGENT_LABEL
once it runs; the controller reads those labels to count warm nodes, to decide
whether pre-staging is done, and to find the agent to send a wipe to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import dscache_contract as contract

from ..api.models import Toleration

#: The informer key under which every node is kept (nodes are cluster-scoped and few).
ALL = ("nodes",)


class NodeInfo(NamedTuple):
    name: str
    address: str | None  # InternalIP: the agent listens there (host network)
    labels: dict[str, str]  # every label but the warm ones (for prestage's nodeSelector)
    taints: tuple[tuple[str, str, str], ...]  # (key, value, effect)
    warm: frozenset[str]  # warm label keys
    agent: bool
    ready: bool
    agent_port: int | None = None  # the agent's label value, when it names a port


def node_info(body: dict[str, Any]) -> NodeInfo:
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    labels = meta.get("labels") or {}
    warm = frozenset(k for k in labels if k.startswith(contract.WARM_LABEL_PREFIX))
    address = next((a.get("address") for a in status.get("addresses") or [] if a.get("type") == "InternalIP"), None)
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return NodeInfo(
        name=meta.get("name", ""),
        address=address,
        labels={k: v for k, v in labels.items() if k not in warm},
        taints=tuple((t.get("key", ""), t.get("value", ""), t.get("effect", "")) for t in spec.get("taints") or []),
        warm=warm,
        agent=contract.AGENT_LABEL in labels,
        ready=ready and not spec.get("unschedulable"),
        agent_port=int(port) if (port := labels.get(contract.AGENT_LABEL, "")).isdigit() else None,
    )


def node_extract(body: dict[str, Any]) -> tuple[tuple[str], NodeInfo]:
    return ALL, node_info(body)


def tolerates(tolerations: Iterable[Toleration], taint: tuple[str, str, str]) -> bool:
    key, value, effect = taint
    for t in tolerations:
        if t.effect and t.effect != effect:
            continue
        if t.operator == "Exists":
            if not t.key or t.key == key:
                return True
        elif t.key == key and (t.value or "") == value:
            return True
    return False


def schedulable_for(node: NodeInfo, selector: dict[str, str], tolerations: list[Toleration]) -> bool:
    """Whether a pod with this nodeSelector and these tolerations may run there (PreferNoSchedule is no bar)."""
    if any(node.labels.get(k) != v for k, v in selector.items()):
        return False
    return all(effect == "PreferNoSchedule" or tolerates(tolerations, (k, v, effect)) for k, v, effect in node.taints)


def warm_nodes(nodes: Iterable[NodeInfo], namespace: str, cache: str, revision: str) -> list[str]:
    key = contract.warm_label(namespace, cache, revision)
    return sorted(n.name for n in nodes if key in n.warm)

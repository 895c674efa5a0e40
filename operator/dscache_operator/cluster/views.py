"""The controller's read-only views of DatasetCaches and users' workloads (see informer.py).

- DatasetCaches -> CacheView by (namespace, name) (caches.py);
- consumer pods (labelled ``dscache.io/consumer=true`` by the webhook) -> PodInfo by (namespace, cache);
- owners, by (namespace, uid) -> OwnerInfo: the Jobs the webhook labelled, and
  every JobSet, PyTorchJob, TrainJob, RayJob, RayCluster and Volcano Job in the
  watched namespaces (the webhook never sees those objects, so they carry no
  label; they are few). Their CRDs are optional: a kind whose CRD is absent is
  an empty view that looks again every minute.

The controller never writes users' objects; it only reads these views.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from dscache_contract import LABEL_CONSUMER

from ..api.models import GROUP, PLURAL, VERSION
from ..kube.client import Kube
from ..kube.informer import MultiInformer, Notify
from .caches import CacheView, Key, cache_extract
from .nodes import ALL, NodeInfo, node_extract
from .workloads import OWNER_KINDS, OwnerInfo, OwnerKind, OwnerLookup, PodInfo, owner_info, pod_info, pod_key

logger = logging.getLogger(__name__)


def _pod_extract(body: dict[str, Any]) -> tuple[tuple[str, str], PodInfo] | None:
    key = pod_key(body)
    return (key, pod_info(body)) if key else None


def _owner_extract(kind: OwnerKind) -> Callable[[dict[str, Any]], tuple[tuple[Any, Any], OwnerInfo]]:
    def extract(body: dict[str, Any]) -> tuple[tuple[Any, Any], OwnerInfo]:
        meta = body.get("metadata") or {}
        return ((meta.get("namespace"), meta.get("uid")), owner_info(kind, body))

    return extract


class Views:
    def __init__(
        self,
        kube: Kube,
        namespaces: tuple[str, ...],
        on_cache: Notify | None = None,
        touch: Callable[[Key], None] | None = None,
    ) -> None:
        """``on_cache``: told of every change to a DatasetCache; ``touch``: told which cache a
        change to its users (a pod, a workload that owns one) may concern."""
        selector = f"{LABEL_CONSUMER}=true"
        self._touch = touch
        # The DatasetCaches themselves (caches.py: what is kept of each), telling the scheduler of changes.
        self.caches = MultiInformer(
            kube, f"/apis/{GROUP}/{VERSION}", PLURAL, namespaces, "", cache_extract, notify=on_cache
        )
        self.pods = MultiInformer(kube, "/api/v1", "pods", namespaces, selector, _pod_extract, notify=self._pod)
        # Nodes: their agents' warm labels and addresses (optional: without RBAC on
        # nodes, no node is known to hold anything and no wipe can be sent).
        self.nodes = MultiInformer(kube, "/api/v1", "nodes", (), "", node_extract, optional=True, notify=self._node)
        self._node_changes = 0
        self.owners: dict[str, MultiInformer] = {}
        for kind in OWNER_KINDS:
            batch_job = kind.kind == "Job"
            self.owners[kind.kind] = MultiInformer(
                kube,
                kind.group_path,
                kind.plural,
                namespaces,
                selector if batch_job else "",
                _owner_extract(kind),
                optional=not batch_job,
                notify=self._owner,
            )

    @property
    def jobs(self) -> MultiInformer:
        return self.owners["Job"]

    def _all(self) -> list[MultiInformer]:
        return [self.caches, self.pods, self.nodes, *self.owners.values()]

    def start(self) -> None:
        for m in self._all():
            m.start()

    async def stop(self) -> None:
        for m in self._all():
            await m.stop()

    async def listed(self, timeout: float) -> None:
        """Wait until every view has listed once, or ``timeout`` seconds (a view that cannot
        list, say without RBAC on pods, must not hold back the source checks for good)."""
        waits = [i.ready.wait() for m in self._all() for i in m.informers.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        except TimeoutError:
            logger.warning(f"not every view has listed after {timeout:.0f}s: reconciling without node decisions")

    def ready(self) -> bool:
        # Not bool(informer): an informer with no objects is falsy (len 0) yet ready.
        return all(m.ready for m in self._all())

    def auth_failing_for(self) -> float:
        return max(m.auth_failing_for() for m in self._all())

    def cache(self, key: Key) -> CacheView | None:
        got = self.caches.get(key)
        return got[0] if got else None

    def all_nodes(self) -> list[NodeInfo]:
        return self.nodes.get(ALL)

    def _pod(self, key: Any, old: PodInfo | None, new: PodInfo | None) -> None:
        # A pod's cache is reconciled as soon as the pod changes, not at its next tick: a pod
        # that lands on a node, stages and is deleted between two ticks would otherwise never be
        # seen there, and the copy it left would be in no node entry, never wiped, not even
        # when the cache is deleted.
        if old != new and self._touch is not None:
            self._touch(key)

    def _owner(self, key: Any, old: OwnerInfo | None, new: OwnerInfo | None) -> None:
        # A workload that finishes (or goes) releases its pods' caches: theirs are due now too.
        if self._touch is None or (old is not None and new is not None and old.finished == new.finished):
            return
        for cache in self.pods.keys_in(key[0]):
            self._touch(cache)

    def _node(self, _key: Any, old: NodeInfo | None, new: NodeInfo | None) -> None:
        # A kubelet rewrites its Node's status every few minutes (heartbeats): what we keep of it
        # (labels, address, readiness) is then equal, and is no change.
        if old != new:
            self._node_changes += 1

    def nodes_seen(self) -> int:
        """Changes so far to what we keep of the nodes (equal: the same nodes as then)."""
        return self._node_changes

    def owner_lookup(self, namespace: str) -> OwnerLookup:
        def lookup(uid: str) -> OwnerInfo | None:
            for m in self.owners.values():
                got = m.get((namespace, uid))
                if got:
                    info: OwnerInfo = got[0]
                    return info
            return None

        return lookup

"""When a cache's periodic reconciliation has nothing to do, and is skipped.

Every cache is reconciled every ``reconcile_interval`` (10 s): at 10,000 caches
that is 1,000 reconciliations a second, each parsing the status, planning every
node's copy and comparing the result with what is written, about 0.7 ms of CPU:
most of a core, spent to find that nothing changed. A reconciliation's outcome
depends only on what it reads (the cache as the informer last saw it, its consumer
pods, the owners it looked up, the nodes) and on the time. So, after a
reconciliation that changed nothing, we keep what it read (``Quiet``) and until
when time alone changes nothing; the next one is skipped while all of it is the
same object as then (every informer event makes a new object, so an edit, a pod's
progress or a Job's end is never missed) and that time has not come.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

from ..cluster.caches import CacheView
from ..cluster.workloads import OwnerInfo, OwnerLookup, PodInfo


class Seen:
    """An owner lookup that remembers what it answered (for ``Quiet.owners``)."""

    def __init__(self, lookup: OwnerLookup) -> None:
        self._lookup = lookup
        self.answers: dict[str, OwnerInfo | None] = {}

    def __call__(self, uid: str) -> OwnerInfo | None:
        info = self.answers[uid] = self._lookup(uid)
        return info


class Quiet(NamedTuple):
    """What a reconciliation that changed nothing read, and until when (a timestamp) that holds."""

    view: CacheView
    pods: tuple[PodInfo, ...]
    owners: tuple[tuple[str, OwnerInfo | None], ...]
    nodes: Hashable
    until: float

    def holds(self, view: CacheView, views: Any, now: float) -> bool:
        """Whether a reconciliation of ``view`` now would read exactly this (and so change nothing)."""
        if now >= self.until or view is not self.view or not views.ready() or views.nodes_seen() != self.nodes:
            return False
        pods = views.pods.get(view.key)
        if len(pods) != len(self.pods) or any(a is not b for a, b in zip(pods, self.pods, strict=True)):
            return False
        lookup = views.owner_lookup(view.namespace)
        return all(lookup(uid) is info for uid, info in self.owners)

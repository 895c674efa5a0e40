"""The controller process's context: the shared Context, and what reconciliation keeps.

What the controller notes per cache is keyed by (namespace, name) and dropped with
the cache (``forget``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from ..cluster.caches import Key, wants_reconcile
from ..cluster.views import Views
from ..context import Context
from ..kube.events import Event, Poster
from ..kube.leader import LeaderElector
from ..kube.schedule import Scheduler
from .agenttokens import AgentTokens
from .sourcecheck import SourceChecks

#: Seconds a reconciliation waits at most for the view to show the status it wrote last.
WRITE_SHOWN_WAIT_S = 5.0


@dataclasses.dataclass
class ControlContext(Context):
    """The controller's Context: its views, queue and Event poster, and per-cache notes."""

    #: The controller's read-only views of caches and users' workloads; set at start-up.
    views: Views | None = None
    #: The queue of caches to reconcile, and the Event poster; set at start-up.
    scheduler: Scheduler | None = None
    poster: Poster | None = None
    #: Per cache: when its source was last checked (monotonic), and how often its deletion has waited.
    checked_at: dict[Key, float] = dataclasses.field(default_factory=dict)
    deleting: dict[Key, int] = dataclasses.field(default_factory=dict)
    #: Per cache: what its last reconciliation read, when it changed nothing (quiet.Quiet).
    quiet: dict[Key, Any] = dataclasses.field(default_factory=dict)
    #: The source checks: Secrets read lately, their threads, equal listings shared.
    sources: SourceChecks = dataclasses.field(init=False)
    #: The controller's tokens for the node agents, one per node (agenttokens.py).
    agent_tokens: AgentTokens = dataclasses.field(default_factory=AgentTokens)
    #: Per cache: the resourceVersion our last status write made, and until when (monotonic) we
    #: wait for the view to show it (``written_shown``).
    written: dict[Key, tuple[str, float]] = dataclasses.field(default_factory=dict)
    #: The caches whose run waits for the view to show that write.
    deferred: set[Key] = dataclasses.field(default_factory=set)
    #: The leader election (kube/leader.py); None: leader election is off, this replica leads.
    elector: LeaderElector | None = None
    #: The task that dispatches reconciliations; it runs only while this replica leads.
    reconciling: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        self.sources = SourceChecks(
            self.metrics,
            self.settings.namespace,
            sts_endpoint=self.settings.sts_endpoint,
            audience=self.settings.sts_audience,
        )

    def post(self, event: Event) -> None:
        """Post an Event about a cache (queued; the poster runs from the controller's start-up)."""
        assert self.poster is not None, "the controller's start-up makes the poster"
        self.poster.post(event)

    def on_cache(self, key: Any, old: Any, new: Any) -> None:
        """The caches' informer saw a change: reconcile now what is news (caches.wants_reconcile),
        or what waited for the view to show our own status write."""
        shown = new is not None and key in self.written and self.written[key][0] == new.resource_version
        if shown:
            del self.written[key]
        waited = shown and key in self.deferred
        self.deferred.discard(key)
        if self.scheduler is not None and (waited or wants_reconcile(old, new)):
            self.scheduler.touch(key)

    def wrote(self, key: Key, resource_version: str | None) -> None:
        """Our status write to ``key`` made ``resource_version``: until the view shows it, the
        cache is not reconciled again (see ``written_shown``)."""
        if resource_version:
            self.written[key] = (resource_version, time.monotonic() + WRITE_SHOWN_WAIT_S)

    def written_shown(self, key: Key, resource_version: str) -> bool:
        """Whether the view (at ``resource_version``) shows our last status write to ``key``.

        A reconciliation reads the node entries it wrote last time from the view. One run on a
        view that does not show them yet (the watch event is milliseconds behind the write, and
        a pod's changes make the cache due at once) plans from the status before: a node entry
        written a moment ago looks absent, and if that node's pod is gone meanwhile, its copy
        is in no entry and never wiped. So a run waits until the view shows the write, or a few
        seconds (a relist replaces the event by a newer version, which shows it as well)."""
        rv, until = self.written.get(key, ("", 0.0))
        if not rv or rv == resource_version or time.monotonic() >= until:
            self.written.pop(key, None)
            self.deferred.discard(key)
            return True
        self.deferred.add(key)  # on_cache makes it due when the write shows
        return False

    def touch(self, key: Key) -> None:
        """A change to a cache's users (its pods, their workloads): reconcile it now."""
        if self.scheduler is not None:
            self.scheduler.touch(key)

    def leading(self) -> bool:
        """May this replica act now (write status, send wipes, create pods)?"""
        return self.elector is None or self.elector.leading

    async def before_stop(self) -> None:
        """SIGTERM: stop acting and hand the Lease over now, not after kopf's shutdown (which
        waits for its root tasks, then runs the cleanup handlers: seconds, during which the
        elector would keep renewing and the standby could only wait)."""
        self.follow()
        if self.elector is not None:
            await self.elector.release()  # closes the elector: no renewal from here on

    def follow(self) -> None:
        """Stop reconciling at once (leadership lost): cancel the dispatcher and every run in
        flight, and drop what reconciliation noted, as the next leader may change anything."""
        if self.reconciling is not None:
            self.reconciling.cancel()
            self.reconciling = None
        if self.scheduler is not None:
            self.scheduler.cancel()
            self.scheduler = None
        # Its per-cache series would be counted beside the new leader's: drop them.
        for key in self.views.caches.held_keys() if self.views is not None else ():
            if isinstance(key, tuple) and len(key) == 2:  # the caches' informer keys by (namespace, name)
                self.metrics.forget_cache(str(key[0]), str(key[1]))
        self.checked_at.clear()
        self.deleting.clear()
        self.quiet.clear()
        self.written.clear()
        self.deferred.clear()
        self.metrics.leader.set(0)

    def forget(self, key: Key) -> None:
        """A cache is gone: drop what we kept about it."""
        self.checked_at.pop(key, None)
        self.deleting.pop(key, None)
        self.quiet.pop(key, None)
        self.written.pop(key, None)
        self.deferred.discard(key)
        self.metrics.forget_cache(*key)


def control_ctx(memo: Any) -> ControlContext:
    """The controller's context from kopf's memo (``__main__`` builds a ControlContext for it)."""
    ctx = memo.ctx
    assert isinstance(ctx, ControlContext), "the controller runs with a ControlContext"
    return ctx

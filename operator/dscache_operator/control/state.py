"""The controller process's context: the shared Context, and what reconciliation keeps.

What the controller notes per cache is keyed by (namespace, name) and dropped with
the cache (``forget``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..cluster.caches import Key, wants_reconcile
from ..cluster.views import Views
from ..context import Context
from ..kube.events import Event, Poster
from ..kube.schedule import Scheduler
from .peertoken import Tokens
from .sourcecheck import SourceChecks


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
    #: Which period each cache's peer token was written for (peertoken.py).
    tokens: Tokens = dataclasses.field(default_factory=Tokens)

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
        """The caches' informer saw a change: reconcile now what is news (caches.wants_reconcile)."""
        if self.scheduler is not None and wants_reconcile(old, new):
            self.scheduler.touch(key)

    def forget(self, key: Key) -> None:
        """A cache is gone: drop what we kept about it."""
        self.checked_at.pop(key, None)
        self.deleting.pop(key, None)
        self.quiet.pop(key, None)
        self.metrics.forget_cache(*key)
        self.tokens.forget(*key)


def control_ctx(memo: Any) -> ControlContext:
    """The controller's context from kopf's memo (``__main__`` builds a ControlContext for it)."""
    ctx = memo.ctx
    assert isinstance(ctx, ControlContext), "the controller runs with a ControlContext"
    return ctx

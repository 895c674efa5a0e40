"""Equal calls share one result, but never one from a call that began too early for them.

A fleet of caches over one bucket asks for the same listing thousands of times at
start-up (10,000 caches: 10,000 listings of the same prefix with the same keys, each
an S3 round trip signed and parsed by botocore). Each caller says how fresh its result
must be: ``not_before``, a time.monotonic() the call must have begun at or after (for
a new cache, when the controller first saw it; for a retry, now). A caller then takes,
in this order:

- the last result of the key, if its call began late enough;
- the call in flight, if it began late enough;
- else the next call, which starts once the one in flight ends and which every caller
  of the key arriving meanwhile shares.

So no caller gets a listing older than it allows (a cache created just after an upload
always sees that upload), and a key has at most one call running and one waiting.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class Coalescer(Generic[T]):
    def __init__(self, keep: float = 60.0, most: int = 256) -> None:
        #: How long, and for how many keys, a finished call's result is kept for later callers.
        self.keep, self.most = keep, most
        self._running: dict[Hashable, tuple[float, asyncio.Task[T]]] = {}
        self._waiting: dict[Hashable, asyncio.Task[T]] = {}
        #: key -> (when its last call began, when it ended, its result)
        self._done: collections.OrderedDict[Hashable, tuple[float, float, T]] = collections.OrderedDict()
        #: Calls made, and callers served by a call they did not start (for the logs and tests).
        self.calls = 0
        self.shared = 0

    async def run(self, key: Hashable, call: Callable[[], Awaitable[T]], not_before: float) -> T:
        done = self._done.get(key)
        if done is not None and done[0] >= not_before:
            self.shared += 1
            return done[2]
        running = self._running.get(key)
        if running is not None and running[0] >= not_before:
            self.shared += 1
            return await asyncio.shield(running[1])
        task = self._waiting.get(key)
        if task is None:
            task = self._waiting[key] = asyncio.ensure_future(self._next(key, call))
        else:
            self.shared += 1
        # shield: a caller cancelled (say, at shutdown) does not cancel the others' call.
        return await asyncio.shield(task)

    async def _next(self, key: Hashable, call: Callable[[], Awaitable[T]]) -> T:
        before = self._running.get(key)
        if before is not None:
            await asyncio.wait([before[1]])  # it began too early for our callers; ours begins after it
        me = self._waiting.pop(key)  # from here on, newcomers wait for the call after this one
        began = time.monotonic()
        self._running[key] = (began, me)
        self.calls += 1
        try:
            result = await call()
        finally:
            if self._running.get(key, (0.0, None))[1] is me:
                del self._running[key]
        self._remember(key, began, result)
        return result

    def _remember(self, key: Hashable, began: float, result: T) -> None:
        now = time.monotonic()
        self._done[key] = (began, now, result)
        self._done.move_to_end(key)
        while self._done and (len(self._done) > self.most or next(iter(self._done.values()))[1] < now - self.keep):
            self._done.popitem(last=False)

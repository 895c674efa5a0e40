"""When each DatasetCache is reconciled: one queue by due time, a few workers.

Why not a kopf timer per cache: a timer whose status write failed (a timeout
while thousands of caches queued for the same connections, a 403, a 422) ends
for good, and kopf never starts it again for that object. At 10,000 caches
that left 4% of them Pending forever while the other timers kept the CPU busy.
Here a failed reconciliation is just due again after a backoff, and the queue
is ordered by due time, so however far behind the workers are, the cache that
has waited longest goes next: no cache starves.

A cache is never reconciled twice at once; a change seen while it is being
reconciled makes it due again as soon as that run ends.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Hashable

logger = logging.getLogger(__name__)

#: A run returns when the key is due next (seconds from now), or None: forget the key.
Run = Callable[[Hashable], Awaitable[float | None]]


class Scheduler:
    def __init__(self, run: Run, workers: int = 8, max_backoff: float = 60.0) -> None:
        self._run = run
        self._slots = asyncio.Semaphore(workers)
        self._max_backoff = max_backoff
        self._heap: list[tuple[float, int, Hashable]] = []
        self._due: dict[Hashable, float] = {}  # the live entry of each waiting key
        self._running: set[Hashable] = set()
        self._again: set[Hashable] = set()  # touched while running
        self._failures: dict[Hashable, int] = {}
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._due) + len(self._running)

    def touch(self, key: Hashable, delay: float = 0.0) -> None:
        """Make ``key`` due in ``delay`` seconds at the latest."""
        if key in self._running:
            self._again.add(key)
            return
        when = time.monotonic() + delay
        if self._due.get(key, float("inf")) <= when:
            return
        self._due[key] = when
        heapq.heappush(self._heap, (when, next(self._seq), key))
        self._wake.set()

    def forget(self, key: Hashable) -> None:
        self._due.pop(key, None)  # its heap entry is skipped when it comes up
        self._again.discard(key)
        self._failures.pop(key, None)

    async def _next(self) -> Hashable:
        while True:
            while self._heap and self._due.get(self._heap[0][2]) != self._heap[0][0]:
                heapq.heappop(self._heap)  # superseded or forgotten
            self._wake.clear()
            if self._heap:
                wait = self._heap[0][0] - time.monotonic()
                if wait <= 0:
                    _, _, key = heapq.heappop(self._heap)
                    del self._due[key]
                    return key
            else:
                wait = None
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except TimeoutError:
                pass

    async def run(self) -> None:
        """Dispatch due keys to at most ``workers`` runs at once, forever."""
        while True:
            await self._slots.acquire()
            try:
                key = await self._next()
            except BaseException:
                self._slots.release()
                raise
            self._running.add(key)
            task = asyncio.create_task(self._one(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, key: Hashable) -> None:
        try:
            delay = await self._run(key)
            self._failures.pop(key, None)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            n = self._failures[key] = self._failures.get(key, 0) + 1
            delay = min(self._max_backoff, 2.0 ** min(n, 10))
            logger.warning(f"reconciling {key} failed ({e!r}); again in {delay:.0f}s", exc_info=n == 1)
        finally:
            self._running.discard(key)
            self._slots.release()
        if delay is None:
            self.forget(key)
            return
        if key in self._again:
            self._again.discard(key)
            delay = 0.0
        self.touch(key, delay)

    def cancel(self) -> None:
        """Cancel the runs in flight now, without waiting (leadership lost: stop acting at once)."""
        for task in list(self._tasks):
            task.cancel()

    async def stop(self) -> None:
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

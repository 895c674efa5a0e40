"""Fetch once per cluster: how much this node reads from the bucket at once while it has peers.

A node that asks the bucket for every object it will read at once gets them all near the end
(they share the link), and its peers, waiting for them, get nothing to pass on until then:
issue 30 measured the first node of 4 to 32 read the whole dataset that way, its peers idle for
its whole copy, then all of them pulling from it at once. Paced, objects come out of the bucket
one after the other, each served on to the peers while the next comes, and a node decides which
objects are its own only when it is about to read them, with the peers it knows of then (a node
that starts a second later takes its share).

The window is what the link carried lately, not a constant: ``FACTOR`` times the bytes that
completed in the last ``SPAN_S`` (at least ``MIN_BYTES``): about FACTOR x SPAN_S seconds of the
link's work in flight. It opens as fast as the link allows (a window that completes in a tenth
of SPAN_S is followed by one FACTOR x 10 times as large, as a TCP slow start): a fast bucket is
not held back, a slow one is not flooded. (Over a quarter second, a batch completing at once
made the window grow four times per batch, whatever the link: every object was claimed within
seconds, as without a window.)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

#: The least in flight, and how many times the bytes completed in the last SPAN_S.
MIN_BYTES = 1 << 20
FACTOR = 2
SPAN_S = 1.0


class Pace:
    """Bytes in flight from the bucket (the event loop only). ``lock``: one worker at a time
    decides and claims its next batch, after ``room``."""

    def __init__(self) -> None:
        self.inflight = 0
        self._done: deque[tuple[float, int]] = deque()
        self._cond = asyncio.Condition()
        self.lock = asyncio.Lock()

    def budget(self) -> int:
        """How many bytes may be in flight now."""
        cut = time.monotonic() - SPAN_S
        while self._done and self._done[0][0] < cut:
            self._done.popleft()
        return max(MIN_BYTES, FACTOR * sum(n for _, n in self._done))

    def room_left(self) -> int:
        return max(0, self.budget() - self.inflight)

    async def room(self) -> None:
        """Until less than the window is in flight (nothing in flight: at once)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.inflight == 0 or self.inflight < self.budget())

    def take(self, nbytes: int) -> None:
        self.inflight += nbytes

    async def give(self, nbytes: int) -> None:
        """``nbytes`` of the bucket's are done (or failed): room for more."""
        async with self._cond:
            self.inflight -= nbytes
            self._done.append((time.monotonic(), nbytes))
            self._cond.notify_all()

"""The stager's pacing of bucket reads while peers share a revision (peers_pace.py, issue 30)."""

from __future__ import annotations

import asyncio

import pytest

from dscache_stager import peers_pace
from dscache_stager.peers_pace import MIN_BYTES, Pace


def test_the_window_starts_small_and_follows_what_completed(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(peers_pace.time, "monotonic", lambda: clock[0])

    async def go() -> None:
        pace = Pace()
        assert pace.budget() == MIN_BYTES
        pace.take(MIN_BYTES)
        assert pace.room_left() == 0
        await pace.give(MIN_BYTES)
        # A window that completed within the span: the next one is FACTOR times larger.
        assert pace.budget() == peers_pace.FACTOR * MIN_BYTES
        clock[0] += peers_pace.SPAN_S + 0.01
        assert pace.budget() == MIN_BYTES, "what completed long ago says nothing of the link now"

    asyncio.run(go())


def test_room_waits_for_a_completion_and_never_with_nothing_in_flight():
    async def go() -> None:
        pace = Pace()
        await asyncio.wait_for(pace.room(), 1)  # nothing in flight: at once
        pace.take(5 * MIN_BYTES)  # one object larger than the window
        waiting = asyncio.create_task(pace.room())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await pace.give(5 * MIN_BYTES)
        await asyncio.wait_for(waiting, 1)

    asyncio.run(go())


@pytest.mark.parametrize("objects", [1, 64])
def test_a_window_is_never_shut_for_good(objects):
    """However the completions fall, a worker waiting for room is let in once the bytes in flight
    are done (a window that shrank below what is in flight must not hold everyone forever)."""

    async def go() -> None:
        pace = Pace()
        sizes = [MIN_BYTES // objects] * objects
        for n in sizes:
            pace.take(n)
        waiting = asyncio.create_task(pace.room())
        for n in sizes:
            await pace.give(n)
        await asyncio.wait_for(waiting, 1)

    asyncio.run(go())

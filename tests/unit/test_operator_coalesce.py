"""coalesce.Coalescer: equal source checks share a listing, never one begun before they allow."""

from __future__ import annotations

import asyncio
import time

from dscache_operator.kube.coalesce import Coalescer


class Lister:
    """A listing that takes ``seconds`` and answers with the bucket's state when it began."""

    def __init__(self, seconds: float = 0.05) -> None:
        self.seconds = seconds
        self.state = 0
        self.begun: list[float] = []

    async def __call__(self) -> int:
        self.begun.append(time.monotonic())
        seen = self.state
        await asyncio.sleep(self.seconds)
        return seen


def test_callers_that_allow_an_earlier_listing_share_one():
    """10,000 caches seen at start-up all accept a listing begun after they were seen: one listing."""

    async def go() -> None:
        c: Coalescer[int] = Coalescer()
        lister = Lister()
        seen = time.monotonic()
        first = await asyncio.gather(*(c.run("k", lister, seen) for _ in range(50)))
        later = await asyncio.gather(*(c.run("k", lister, seen) for _ in range(50)))  # from the kept result
        assert first == later == [0] * 50
        assert c.calls == 1 and c.shared == 99 and len(lister.begun) == 1

    asyncio.run(go())


def test_a_caller_never_joins_a_listing_begun_before_it_allows():
    """An upload, then a cache: its check must not take a listing that began before the upload."""

    async def go() -> None:
        c: Coalescer[int] = Coalescer()
        lister = Lister(seconds=0.1)
        early = asyncio.ensure_future(c.run("k", lister, time.monotonic()))
        await asyncio.sleep(0.02)  # that listing is under way...
        lister.state = 1  # ...when the user uploads,
        asked = time.monotonic()  # then creates the cache
        late = await asyncio.gather(*(c.run("k", lister, asked) for _ in range(5)))
        assert await early == 0
        assert late == [1] * 5, "the late callers share the next listing, begun after they asked"
        assert len(lister.begun) == 2 and lister.begun[1] >= asked
        # A finished result that began too early is not reused either.
        lister.state = 2
        assert await c.run("k", lister, time.monotonic()) == 2
        assert len(lister.begun) == 3

    asyncio.run(go())


def test_keys_never_share_and_failures_reach_every_caller_but_are_not_kept():
    async def go() -> None:
        c: Coalescer[int] = Coalescer()
        calls: list[str] = []

        async def failing() -> int:
            calls.append("fail")
            await asyncio.sleep(0.01)
            raise RuntimeError("boom")

        async def other() -> int:
            calls.append("other")
            return 7

        now = time.monotonic()
        results = await asyncio.gather(
            *(c.run("a", failing, now) for _ in range(3)), c.run("b", other, now), return_exceptions=True
        )
        assert [type(r) for r in results[:3]] == [RuntimeError] * 3 and results[3] == 7
        assert sorted(calls) == ["fail", "other"]
        # The failure was not kept: the next caller lists again.
        try:
            await c.run("a", failing, now)
        except RuntimeError:
            pass
        assert calls.count("fail") == 2

    asyncio.run(go())


def test_kept_results_are_bounded():
    async def go() -> None:
        c: Coalescer[int] = Coalescer(keep=60.0, most=3)

        async def one() -> int:
            return 1

        for key in range(10):
            await c.run(key, one, 0.0)
        assert len(c._done) == 3

    asyncio.run(go())

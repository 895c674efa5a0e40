"""The Lease leader elector's state machine (kube/leader.py), on virtual time and an
in-memory Lease store with the API server's optimistic concurrency (409 on a stale
resourceVersion). The real API server is in tests/integration/test_operator_leader.py."""

from __future__ import annotations

import asyncio
import copy
import datetime
import heapq
import itertools
from typing import Any

import pytest

from dscache_operator.kube.client import ApiError
from dscache_operator.kube.leader import Clock, LeaderElector, LeaseConfig

PATH = "/apis/coordination.k8s.io/v1/namespaces/sys/leases/ctl"


class VirtualTime:
    """A clock whose sleeps end in virtual-time order; ``run_until`` advances it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def clock(self) -> Clock:
        return Clock(
            monotonic=lambda: self.now,
            wall=lambda: datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=self.now),
            sleep=self.sleep,
        )

    async def sleep(self, seconds: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._seq), fut))
        await fut

    async def run_until(self, end: float, each_tick: Any = None) -> None:
        while True:
            for _ in range(20):  # let every task reach its next sleep
                await asyncio.sleep(0)
            if each_tick is not None:
                each_tick()
            if not self._sleepers or self._sleepers[0][0] > end:
                self.now = end
                return
            when, _, fut = heapq.heappop(self._sleepers)
            self.now = max(self.now, when)
            if not fut.done():
                fut.set_result(None)


class FakeLeases:
    """One Lease, as the API server keeps it: create is 409 if it exists, an update is 409
    unless it names the current resourceVersion. ``down`` holds identities whose calls fail."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down: set[str] = set()
        self.writes: list[str] = []

    def for_(self, identity: str) -> Any:
        leases = self

        class Api:
            async def get(self, path: str) -> dict[str, Any] | None:
                assert path == PATH
                if identity in leases.down:
                    raise OSError("connection refused")
                return copy.deepcopy(leases.lease)

            async def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
                if identity in leases.down:
                    raise OSError("connection refused")
                if method == "POST":
                    if leases.lease is not None:
                        raise ApiError(409, "AlreadyExists")
                elif body["metadata"].get("resourceVersion") != str(leases.version):
                    raise ApiError(409, "Conflict")
                leases.version += 1
                leases.lease = {
                    "metadata": {"name": "ctl", "namespace": "sys", "resourceVersion": str(leases.version)},
                    "spec": copy.deepcopy(body["spec"]),
                }
                leases.writes.append(body["spec"]["holderIdentity"])
                return copy.deepcopy(leases.lease)

        return Api()


class Replica:
    def __init__(self, leases: FakeLeases, vt: VirtualTime, identity: str) -> None:
        self.events: list[tuple[float, str]] = []
        self.elector = LeaderElector(
            leases.for_(identity),
            LeaseConfig("sys", "ctl", identity),
            on_started=lambda: self.events.append((vt.now, "started")),
            on_stopped=lambda: self.events.append((vt.now, "stopped")),
            clock=vt.clock(),
        )
        self.acting = False  # what the controller does with the callbacks

    def start(self) -> asyncio.Task[None]:
        return asyncio.create_task(self.elector.run())


def simulate(scenario: Any) -> None:
    asyncio.run(scenario())


def test_config_must_let_a_leader_stop_before_others_take_over():
    LeaseConfig("ns", "n", "me")  # controller-runtime's 15 / 10 / 2
    with pytest.raises(ValueError):
        LeaseConfig("ns", "n", "me", lease_duration=10, renew_deadline=10)
    with pytest.raises(ValueError):
        LeaseConfig("ns", "n", "me", renew_deadline=2, retry_period=2)


def test_one_leader_renews_and_the_standby_waits():
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a, b = Replica(leases, vt, "a"), Replica(leases, vt, "b")
        tasks = [a.start()]
        await vt.run_until(1.0)
        tasks.append(b.start())
        await vt.run_until(120.0)
        assert a.events == [(0.0, "started")] and b.events == []
        assert a.elector.leading and not b.elector.leading
        assert b.elector.holder == "a"
        # Renewed every retry period (2 s): ~60 writes in 120 s, all by a.
        assert set(leases.writes) == {"a"} and 55 <= len(leases.writes) <= 62, len(leases.writes)
        assert leases.lease is not None and leases.lease["spec"]["leaseTransitions"] == 0
        for t in tasks:
            t.cancel()

    simulate(scenario)


def test_a_leader_that_cannot_renew_stops_before_the_standby_starts():
    """The leader's API calls fail from t=10: it stops at its renew deadline (10 s after
    its last renewal); the standby starts only once the record has been unchanged for a
    lease duration (15 s) on its own clock. At no instant do both lead."""
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a, b = Replica(leases, vt, "a"), Replica(leases, vt, "b")
        tasks = [a.start(), b.start()]
        await vt.run_until(10.0)
        leases.down.add("a")
        last_renewal = vt.now  # a renewed at t=10 (every 2 s from 0) just before its calls failed
        both: list[float] = []
        await vt.run_until(
            60.0, each_tick=lambda: both.append(vt.now) if a.elector.leading and b.elector.leading else None
        )
        assert both == []
        (stopped,) = [t for t, e in a.events if e == "stopped"]
        (started,) = [t for t, e in b.events if e == "started"]
        assert stopped <= last_renewal + 10.0
        assert last_renewal + 15.0 <= started <= last_renewal + 15.0 + 2.0 + 1e-9, (started, last_renewal)
        assert stopped < started
        assert leases.lease is not None and leases.lease["spec"]["holderIdentity"] == "b"
        assert leases.lease["spec"]["leaseTransitions"] == 1
        # a comes back: it finds b's live lease and stays a standby.
        leases.down.clear()
        await vt.run_until(120.0)
        assert [e for _, e in a.events] == ["started", "stopped"] and not a.elector.leading
        assert b.elector.leading
        for t in tasks:
            t.cancel()

    simulate(scenario)


def test_leading_reads_false_past_the_deadline_even_if_the_loop_never_ran():
    """``leading`` is computed from the last renewal, not from a flag the loop must clear."""
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a = Replica(leases, vt, "a")
        task = a.start()
        await vt.run_until(0.5)
        assert a.elector.leading
        vt.now = 9.9  # the event loop starved: no renewal ran since t=0
        assert a.elector.leading
        vt.now = 10.0
        assert not a.elector.leading
        task.cancel()

    simulate(scenario)


def test_a_hung_renewal_is_cut_at_the_renew_deadline():
    """A renewal the API server never answers: the leader still stops at the deadline (real
    time, small durations: the deadline is an asyncio timeout)."""

    class Hanging:
        hang = False

        def __init__(self) -> None:
            self.inner = FakeLeases().for_("a")

        async def get(self, path: str) -> dict[str, Any] | None:
            if self.hang:
                await asyncio.Event().wait()
            return await self.inner.get(path)

        async def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
            return await self.inner.request(method, path, body)

    async def scenario() -> None:
        api = Hanging()
        stopped: list[float] = []
        loop = asyncio.get_running_loop()
        el = LeaderElector(
            api,
            LeaseConfig("sys", "ctl", "a", lease_duration=0.6, renew_deadline=0.4, retry_period=0.1),
            on_started=lambda: None,
            on_stopped=lambda: stopped.append(loop.time()),
        )
        task = asyncio.create_task(el.run())
        await asyncio.sleep(0.25)
        assert el.leading
        api.hang = True
        hung_at = loop.time()
        await asyncio.sleep(0.8)
        assert stopped and stopped[0] - hung_at <= 0.4 + 0.1, stopped[0] - hung_at
        assert not el.leading
        task.cancel()

    simulate(scenario)


def test_release_hands_over_within_a_retry_period():
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a, b = Replica(leases, vt, "a"), Replica(leases, vt, "b")
        ta, tb = a.start(), b.start()
        await vt.run_until(30.0)
        ta.cancel()
        await vt.run_until(30.0)
        await a.elector.release()
        assert leases.lease is not None and leases.lease["spec"]["holderIdentity"] == ""
        await vt.run_until(40.0)
        (started,) = [t for t, e in b.events if e == "started"]
        assert 30.0 < started <= 32.0 + 1e-9
        assert [e for _, e in a.events] == ["started", "stopped"]
        tb.cancel()

    simulate(scenario)


def test_release_while_still_running_closes_the_elector_for_good():
    """SIGTERM releases before kopf's shutdown has cancelled anything: ``run`` is still
    going, and must not renew (or campaign) again; it ends on its own."""
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a, b = Replica(leases, vt, "a"), Replica(leases, vt, "b")
        ta, tb = a.start(), b.start()
        await vt.run_until(30.0)
        assert a.elector.leading
        await a.elector.release()  # ta is not cancelled
        writes = len(leases.writes)
        assert leases.lease is not None and leases.lease["spec"]["holderIdentity"] == ""
        assert leases.lease["spec"]["leaseDurationSeconds"] == 1
        await vt.run_until(60.0)
        assert "a" not in leases.writes[writes:], leases.writes[writes:]
        assert not a.elector.leading and ta.done() and ta.exception() is None
        (started,) = [t for t, e in b.events if e == "started"]
        assert 30.0 < started <= 32.0 + 1e-9
        assert [e for _, e in a.events] == ["started", "stopped"]
        tb.cancel()

    simulate(scenario)


def test_a_try_that_has_read_the_lease_writes_nothing_once_released():
    """A renewal whose read was in flight when release began must not write after it."""
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a = Replica(leases, vt, "a")
        ta = a.start()
        await vt.run_until(5.0)
        api = a.elector.api
        reading = asyncio.Event()
        go_on = asyncio.Event()
        plain_get = api.get

        async def slow_get(path: str) -> dict[str, Any] | None:
            got = await plain_get(path)
            reading.set()
            await go_on.wait()
            return got

        api.get = slow_get  # type: ignore[method-assign]
        renewal = asyncio.create_task(vt.run_until(7.0))  # the next renewal (every 2 s) reads...
        await reading.wait()
        api.get = plain_get  # type: ignore[method-assign]
        await a.elector.release()  # ...and meanwhile the process is told to stop
        released = copy.deepcopy(leases.lease)
        go_on.set()
        await renewal
        await vt.run_until(20.0)
        assert leases.lease == released and released is not None
        assert released["spec"]["holderIdentity"] == ""
        ta.cancel()

    simulate(scenario)


def test_release_wins_over_a_renewal_that_landed_first():
    """A renewal sent before release, landing after our last read: release gets 409, reads
    again, and releases what is still ours."""
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a, b = Replica(leases, vt, "a"), Replica(leases, vt, "b")
        ta, tb = a.start(), b.start()
        await vt.run_until(9.0)
        ta.cancel()  # a renewal whose answer a never read: the Lease moved on without a knowing
        await vt.run_until(9.0)
        assert leases.lease is not None
        leases.version += 1
        leases.lease["metadata"]["resourceVersion"] = str(leases.version)
        leases.lease["spec"]["renewTime"] = "2026-01-01T00:00:09.000000Z"
        await a.elector.release()
        assert leases.lease["spec"]["holderIdentity"] == ""
        await vt.run_until(12.0)
        assert b.elector.leading
        tb.cancel()

    simulate(scenario)


def test_a_renewal_answered_after_release_is_released_over_and_does_not_lead():
    """The renewal was written by the API server, its answer still on its way, when release
    begins: release's write is 409, it reads the Lease again and releases it; the late answer
    does not make the elector lead again."""
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a = Replica(leases, vt, "a")
        ta = a.start()
        await vt.run_until(5.0)
        api = a.elector.api
        written = asyncio.Event()
        answer = asyncio.Event()
        plain_request = api.request

        async def late_answer(method: str, path: str, body: Any = None) -> dict[str, Any]:
            got = await plain_request(method, path, body)
            written.set()
            await answer.wait()
            return got

        api.request = late_answer  # type: ignore[method-assign]
        renewal = asyncio.create_task(vt.run_until(7.0))
        await written.wait()
        api.request = plain_request  # type: ignore[method-assign]
        await a.elector.release()
        assert leases.lease is not None and leases.lease["spec"]["holderIdentity"] == ""
        answer.set()
        await renewal
        await vt.run_until(20.0)
        assert not a.elector.leading and leases.lease["spec"]["holderIdentity"] == ""
        assert [e for _, e in a.events] == ["started", "stopped"]
        ta.cancel()

    simulate(scenario)


def test_release_leaves_a_lease_another_took_meanwhile():
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a = Replica(leases, vt, "a")
        ta = a.start()
        await vt.run_until(3.0)
        ta.cancel()
        await vt.run_until(3.0)
        assert leases.lease is not None
        leases.version += 1
        leases.lease["metadata"]["resourceVersion"] = str(leases.version)
        leases.lease["spec"]["holderIdentity"] = "b"
        await a.elector.release()
        assert leases.lease["spec"]["holderIdentity"] == "b"

    simulate(scenario)


def test_a_stopping_standby_never_takes_the_lease():
    """SIGTERM on the standby: it writes nothing, and does not grab the Lease the leader
    releases later while its own shutdown is still going."""
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        a, b = Replica(leases, vt, "a"), Replica(leases, vt, "b")
        ta, tb = a.start(), b.start()
        await vt.run_until(10.0)
        await b.elector.release()
        assert leases.lease is not None and leases.lease["spec"]["holderIdentity"] == "a"
        await vt.run_until(12.0)
        await a.elector.release()
        await vt.run_until(40.0)
        assert "b" not in leases.writes and b.events == [] and tb.done()
        assert leases.lease["spec"]["holderIdentity"] == "" and ta.done()

    simulate(scenario)


def test_a_restarted_replica_takes_its_own_lease_back_at_once():
    """The identity is the pod's name: a restarted container of that pod does not wait out
    its own lease (its old process is dead)."""
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        first = Replica(leases, vt, "pod-1")
        t1 = first.start()
        await vt.run_until(5.0)
        t1.cancel()  # killed: no release
        await vt.run_until(6.0)
        again = Replica(leases, vt, "pod-1")
        t2 = again.start()
        await vt.run_until(6.5)
        assert again.events == [(6.0, "started")]
        t2.cancel()

    simulate(scenario)


def test_two_candidates_for_a_missing_lease_one_wins():
    leases, vt = FakeLeases(), VirtualTime()

    async def scenario() -> None:
        reps = [Replica(leases, vt, name) for name in ("a", "b", "c")]
        tasks = [r.start() for r in reps]
        await vt.run_until(50.0)
        leaders = [r for r in reps if r.elector.leading]
        assert len(leaders) == 1
        assert sum(1 for r in reps for _, e in r.events if e == "started") == 1
        for t in tasks:
            t.cancel()

    simulate(scenario)


def test_losing_leadership_stops_every_run_in_flight_at_once():
    """ControlContext.follow (the elector's on_stopped): the dispatcher and the runs already
    going are cancelled synchronously, the queue is dropped (a new one is made on the next
    lead), and the gauge reads 0; reconciling again needs a new lead."""
    from dscache_operator.control.state import ControlContext
    from dscache_operator.kube.schedule import Scheduler
    from dscache_operator.settings import Settings

    async def scenario() -> None:
        ctx = ControlContext(settings=Settings(peers=False))
        started, finished = asyncio.Event(), []

        async def run(key: Any) -> float | None:
            started.set()
            await asyncio.sleep(30)  # a reconciliation waiting on the API server
            finished.append(key)
            return None

        scheduler = Scheduler(run)
        ctx.scheduler = scheduler
        ctx.reconciling = asyncio.create_task(scheduler.run())
        ctx.metrics.leader.set(1)
        scheduler.touch(("ml", "c"))
        await asyncio.wait_for(started.wait(), 5)
        reconciling = ctx.reconciling
        ctx.follow()
        assert ctx.scheduler is None and ctx.reconciling is None
        await asyncio.sleep(0)  # cancellation is delivered on the next loop turn
        await asyncio.sleep(0)
        assert reconciling.cancelled() and not scheduler._tasks and finished == []
        assert ctx.metrics.registry.get_sample_value("dscache_controller_leader") == 0
        ctx.on_cache(("ml", "c"), None, object())  # a change seen while standing by: nothing queued

    simulate(scenario)

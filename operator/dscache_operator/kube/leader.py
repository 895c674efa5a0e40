"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does.

Two controller replicas run; only the one holding the Lease reconciles, the other keeps
its informers warm and takes over when the Lease expires. The timings are
controller-runtime's defaults: a 15 s lease, a 10 s renew deadline, a try every 2 s.

Why it is safe (never two leaders acting):

- A candidate takes the Lease only after it has seen the same record, unchanged, for a
  whole lease duration on *its own* clock (``_observed_at``), so skewed wall clocks between
  nodes do not matter; every write carries the resourceVersion it read, so two
  candidates racing for it cannot both win (the loser gets 409).
- The leader stops (``on_stopped``, synchronously) as soon as it has not renewed for the
  renew deadline (10 s), which is shorter than the lease (15 s) the others wait out; a
  renewal hung in the API server is bounded by the same deadline. ``leading`` itself is
  computed from the last renewal, so even a starved event loop never reads a stale True.
- On SIGTERM the leader releases the Lease *first*, before anything else of the shutdown
  (client-go's ReleaseOnCancel): it stops acting, empties the holder with a 1 s lease, and
  from then on never writes the Lease again (``release`` closes the elector: a try already
  past its read writes nothing, a renewal in flight that wins the race is released over).
  So a rolling update or a drain hands over in about one retry period, however long the
  rest of the process's shutdown takes, instead of a lease duration.

The identity is the pod's name: a restarted container of the same pod takes its own Lease
back on its first try (the old container is dead; the kubelet starts a new one only then).
When a replica makes that first try is the caller's choice (control/reconcile.py: once its
views are warm, so that a released Lease goes to the warm standby).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .client import ApiError

logger = logging.getLogger(__name__)

#: client-go's MicroTime: RFC 3339 with microseconds, UTC.
MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"


class LeaseApi(Protocol):
    """The two calls of kube.client.Kube the elector uses (a fake in unit tests)."""

    async def get(self, path: str) -> dict[str, Any] | None: ...

    async def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        # client-go's own checks: a leader must give up before others may take over.
        if not self.lease_duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError("leader election needs lease duration > renew deadline > retry period > 0")

    @property
    def path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.name}"

    @property
    def collection(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"


@dataclasses.dataclass
class Clock:
    """Injected time: the monotonic clock for every decision, the wall clock only for what
    the Lease shows people (renewTime), and sleep."""

    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep


class LeaderElector:
    def __init__(
        self,
        api: LeaseApi,
        config: LeaseConfig,
        on_started: Callable[[], None],
        on_stopped: Callable[[], None],
        clock: Clock | None = None,
    ) -> None:
        self.api = api
        self.config = config
        self._on_started = on_started
        self._on_stopped = on_stopped
        self.clock = clock or Clock()
        #: The Lease's spec as last read, and when (monotonic) it last changed.
        self._observed: dict[str, Any] | None = None
        self._observed_at = 0.0
        self._resource_version: str | None = None
        #: When (monotonic) we last wrote the Lease as its holder; None: we do not lead.
        self._renewed_at: float | None = None
        #: Who holds the Lease, as last read (for logs and status).
        self.holder: str | None = None
        #: Set by ``release``: this elector never writes the Lease again (shutting down).
        self.closed = False

    @property
    def leading(self) -> bool:
        """True only while our last renewal is younger than the renew deadline."""
        return self._renewed_at is not None and self.clock.monotonic() - self._renewed_at < self.config.renew_deadline

    async def run(self) -> None:
        """Campaign, lead until a renewal fails for the renew deadline, campaign again; forever."""
        try:
            while not self.closed:
                await self._acquire()
                if self.closed:
                    return
                self._start()
                await self._renew()
                if self._renewed_at is not None:  # (release has stopped it already)
                    self._stop("could not renew the lease within the renew deadline")
        finally:
            if self._renewed_at is not None:
                self._stop("shutting down")

    async def release(self, attempts: int = 3) -> None:
        """Give the Lease up for good (the process is stopping): stop acting at once, then
        empty the holder with a 1 s lease so the other replica takes it on its next try.

        From the first line on, the elector is closed: ``run`` (if not cancelled yet) makes no
        further write. A renewal already sent may still land before ours, and our write then
        gets 409: read the Lease again and release what is still ours. A Lease another holds
        by then is left alone."""
        self.closed = True
        if self._renewed_at is not None:
            self._stop("releasing the lease")
        for _ in range(attempts):
            if self.holder != self.config.identity or self._observed is None:
                return
            spec = dict(self._observed, holderIdentity="", leaseDurationSeconds=1, renewTime=self._now())
            try:
                await self._write(spec)
                logger.info(f"released lease {self.config.namespace}/{self.config.name}")
                return
            except ApiError as e:
                if e.status != 409:
                    logger.warning(f"could not release lease {self.config.name}: {e}")
                    return
            except (OSError, TimeoutError) as e:
                logger.warning(f"could not release lease {self.config.name}: {e!r}")
                return
            # 409: a renewal of ours (or another's takeover) landed first; see which.
            try:
                lease = await self.api.get(self.config.path)
            except (ApiError, OSError, TimeoutError) as e:
                logger.warning(f"could not release lease {self.config.name}: {e!r}")
                return
            if lease is None:
                return
            self._observe(lease)

    # --- the state machine ---------------------------------------------------------------

    async def _acquire(self) -> None:
        while not await self._try():
            if self.closed:
                return
            await self.clock.sleep(self.config.retry_period)

    async def _renew(self) -> None:
        """Renew every retry period; return once leadership is lost."""
        cfg = self.config
        while True:
            await self.clock.sleep(cfg.retry_period)
            if self._renewed_at is None:
                return  # released meanwhile
            left = cfg.renew_deadline - (self.clock.monotonic() - self._renewed_at)
            if left <= 0:
                return
            try:
                ok = await asyncio.wait_for(self._try(), left)
            except TimeoutError:
                ok = False
            if not ok and (self.holder not in (None, "", cfg.identity) or not self.leading):
                return  # another holds it (we were too late), or the deadline has passed

    async def _try(self) -> bool:
        """One try to acquire or renew (client-go's tryAcquireOrRenew). True: we hold it now."""
        cfg = self.config
        if self.closed:
            return False
        try:
            lease = await self.api.get(cfg.path)
            if self.closed:  # released while we read: never write after release
                return False
            if lease is None:
                spec = self._spec(None)
                created = await self.api.request(
                    "POST",
                    cfg.collection,
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                        "spec": spec,
                    },
                )
                self._took(created)
                return True
            self._observe(lease)
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            duration = float(spec.get("leaseDurationSeconds") or cfg.lease_duration)
            if holder and holder != cfg.identity and self.clock.monotonic() - self._observed_at < duration:
                return False  # another's, and not expired as far as we have seen
            written = await self._write(self._spec(spec))
            self._took(written)
            return True
        except ApiError as e:
            if e.status != 409:  # 409: another candidate wrote first; simply not ours
                logger.warning(f"lease {cfg.namespace}/{cfg.name}: {e}")
            return False
        except (OSError, TimeoutError, ValueError) as e:
            logger.warning(f"lease {cfg.namespace}/{cfg.name}: {e!r}")
            return False

    def _spec(self, old: dict[str, Any] | None) -> dict[str, Any]:
        cfg = self.config
        now = self._now()
        ours = bool(old) and (old or {}).get("holderIdentity") == cfg.identity
        transitions = int((old or {}).get("leaseTransitions") or 0)
        return {
            "holderIdentity": cfg.identity,
            "leaseDurationSeconds": int(cfg.lease_duration),
            "acquireTime": (old or {}).get("acquireTime") if ours else now,
            "renewTime": now,
            "leaseTransitions": transitions if ours or old is None else transitions + 1,
        }

    async def _write(self, spec: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": cfg.name, "namespace": cfg.namespace, "resourceVersion": self._resource_version},
            "spec": spec,
        }
        written = await self.api.request("PUT", cfg.path, body)
        self._observe(written)
        return written

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = lease.get("spec") or {}
        self._resource_version = (lease.get("metadata") or {}).get("resourceVersion")
        self.holder = spec.get("holderIdentity") or ""
        if spec != self._observed:
            self._observed = spec
            self._observed_at = self.clock.monotonic()

    def _took(self, lease: dict[str, Any]) -> None:
        self._observe(lease)
        if not self.closed:  # a renewal answered after release: release writes over it, we do not lead
            self._renewed_at = self.clock.monotonic()

    def _start(self) -> None:
        logger.info(f"leading: holding lease {self.config.namespace}/{self.config.name} as {self.config.identity}")
        self._on_started()

    def _stop(self, why: str) -> None:
        self._renewed_at = None
        logger.warning(f"no longer leading ({why}): reconciling stops")
        self._on_stopped()

    def _now(self) -> str:
        return self.clock.wall().astimezone(datetime.UTC).strftime(MICROTIME)

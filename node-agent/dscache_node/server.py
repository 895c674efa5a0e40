"""The agent's HTTP API on the host network (contract: dscache_contract.node).

GET  /healthz       200 while the disk was read lately
GET  /metrics       Prometheus
POST /v1/reserve    the stager: room for a copy (a consumer pod of the cache on this node; a
                    stager must hold C's lock)
POST /v1/wipe       the controller: release leases, remove a revision (its token for this node)
POST /v1/peers      the stager: who else stages or holds its revision (a consumer pod of the cache
                    on this node; it must hold C's lock and be copying that revision)
GET  /v1/objects/<namespace>/<cache>/<revision>/<path>?wait=<s>[&probe=1...&size=<n>]
                    a peer's stager: one complete object (a consumer pod of the cache, any node),
                    or, given its size, one a stager here still writes, as it comes (_follow)
POST /v1/objects-batch
                    a peer's stager: the small objects of a list that are whole here now, in one
                    answer (never held; the same gate and bounds as one object)
GET  /v1/listings/<namespace>/<cache>/<revision>?wait=<s>
                    a peer's stager: the revision's checked listing (listings.py; the same gate)

Who is who: Kubernetes ServiceAccount tokens, checked by TokenReview (auth.py); with
a certificate, the server speaks TLS (docs/security.md).

Every node's agent listens on the host network, reachable by any pod, so the server
assumes hostile clients (aiohttp, asyncio: a connection costs a socket and a small
object, not a thread):
- connections: at most ``MAX_CONNECTIONS``, ``MAX_PER_CLIENT`` from one address; the
  next ``BUSY_PER_CLIENT`` from that address get a 429 to their first request and are
  closed (a stager told "busy" asks again soon; a reset connection would look like a
  dead peer and be written off, its objects read from the bucket), any more are reset
  at once; one without a whole request for ``IDLE_S`` (idle keep-alive, or headers
  trickled in) is closed; a request body must arrive within ``BODY_S``, and an
  object's body be taken at ``MIN_RATE`` at least;
- work: the calls that read or change the disk or the Node run on a small pool
  (``CONTROL_THREADS``), at most ``CONTROL_PER_CLIENT`` of them per address; the token
  checks of the peers' reads (objects, listings) on a pool of their own (``CHECK_THREADS``,
  the same share per address), so this node's own stager and the controller never wait
  behind the other nodes' first requests; held
  object requests at most ``OBJECTS_PER_CLIENT`` per address and ``MAX_OBJECTS`` in
  all. Past a bound the answer is 429 (the stager asks the next node or the
  bucket), so healthz and wipes always find room;
- every request but healthz and metrics carries a token: the controller's for wipes,
  a consumer pod's for the rest (auth.py); a malformed request is answered 4xx, never
  with a dropped connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dscache_contract import RESERVE_PATH, WIPE_PATH, ArgsError, ReserveRequest, WipeRequest
from dscache_contract.listings import LISTINGS_PATH
from dscache_contract.peers import (
    BATCH_OBJECT_MAX,
    GROWN_XATTR,
    OBJECTS_BATCH_PATH,
    OBJECTS_PATH,
    PEERS_PATH,
    PROBE_PARAM,
    REVISION_HEADER,
    ObjectRequest,
    ObjectsBatchRequest,
    PeersRequest,
    RevisionState,
    claims_path,
    grow_name,
)
from dscache_stager.errors import BusyError, UsageError

from .agent import Agent, _locked
from .arrivals import Arrivals
from .auth import Gate, NeedsApi, Refusal
from .kube import ApiError
from .listings import serve_listing
from .peers import (
    REVISION_DIRS,
    Claims,
    NotHere,
    Opened,
    check_request,
    open_growing,
    open_object,
    open_tmp_dir,
    poll_object,
    revision_state,
)

log = logging.getLogger("dscache-node")
T = TypeVar("T")

MAX_BODY = 1 << 20
#: Open connections in all, and from one address. A stager uses up to 64 for a peer's objects, and
#: a node's stagers all come from the node's address (hostNetwork, or pods masqueraded): room for
#: two at once. Past that, BUSY_PER_CLIENT more are answered 429 (busy), not reset.
MAX_CONNECTIONS = 512
MAX_PER_CLIENT = 160
BUSY_PER_CLIENT = 64
#: A connection without a whole request for this long is closed (idle, or headers trickled in).
IDLE_S = 15.0
#: A request body (at most MAX_BODY) must arrive within this long.
BODY_S = 10.0
#: Threads for the calls that touch the disk or the API server, and how many one address may use.
CONTROL_THREADS = 8
CONTROL_PER_CLIENT = 4
#: Threads for the token checks of the peers' reads (a TokenReview and a pod's GET per new token).
#: Not the control pool: at a cohort's start every other node's stager shows this agent a new token
#: at once (N - 1 checks, each seconds long on a loaded API server); on the control pool they held
#: every thread while this node's own stager waited to reserve and to ask for its peers, past its
#: 10 s timeout (issue 30, N = 32: those nodes read every object from the bucket).
CHECK_THREADS = 8
#: A control call answered after this long is logged, with where the time went.
SLOW_ANSWER_S = 2.0
#: Object requests in progress (held or sending), in all and from one address (two stagers).
MAX_OBJECTS = 256
OBJECTS_PER_CLIENT = 128
#: Bodies sent at once (the others wait their turn, within their request's wait, at least
#: MIN_TURN_S): the uplink is shared by that many, not by every request held here.
MAX_SENDING = 8
MIN_TURN_S = 1.0
#: Bodies up to this size are read into memory and sent with their headers in one write, without
#: a sending turn: a stager's small objects (issue 30: 100,000 x 16 KiB) spent a third of the
#: agent's loop writing the headers (a send of their own) and a seventh in asyncio's sendfile
#: machinery (a writer callback, a future, a second send), for a body the socket buffer takes at once.
SMALL_BODY = 64 << 10
#: An object's body must be taken within READ_GRACE_S plus its size at MIN_RATE.
READ_GRACE_S = 30.0
MIN_RATE = 1 << 20
#: How often a held request looks again for the object it waits for (whether the file is there)
#: when its directory cannot be watched (arrivals.py), and how often it looks at the lock, the
#: revision's state and the claims too.
POLL_S = 0.05
FULL_LOOK_S = 1.0
#: A body followed as it grows (a stager's grow file) is looked at this often while it has fewer
#: than GROW_SEND new bytes (and is not whole), and given up (the connection closed, the peer asks
#: again) after GROW_STALL_S without any. A send per GROW_SEND, not per look: each send is a wake
#: of the loop and a syscall through the network stack, paid per follower (issue 30).
GROW_POLL_S = 0.02
GROW_SEND = 64 << 10
GROW_STALL_S = 30.0
#: And passed on in reads of at most this much.
GROW_CHUNK = 256 << 10
#: A full look (the lock, the revision's state, the claims) is made on the loop, not on a thread,
#: while the revision's claims file grew by less than this since the last look: a few syscalls and
#: a short read, where the thread hop cost a sixth of the agent's loop (issue 30: 20,000 x 16 KiB
#: on 4 nodes, a tenth of the probes answered "unclaimed"). A claims file seen for the first time,
#: or grown by more, is read on a thread (a large revision's paths).
LOOP_CLAIMS_BYTES = 64 << 10


class _Limits:
    """Per-address and overall counters (the event loop's thread only: no lock)."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self.by_client: Counter[str] = Counter()
        self.n = 0

    def take(self, client: str) -> bool:
        if self.n >= self.total or self.by_client[client] >= self.per_client:
            return False
        self.n += 1
        self.by_client[client] += 1
        return True

    def give(self, client: str) -> None:
        self.n -= 1
        self.by_client[client] -= 1
        if self.by_client[client] <= 0:
            del self.by_client[client]


class _Pool:
    """Threads for blocking calls, with their per-address and overall bounds (past them: 429)."""

    def __init__(self, threads: int, per_client: int, name: str) -> None:
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        #: Calls running or queued: a few per thread, so a burst waits briefly instead of a 429.
        self.limits = _Limits(threads * 4, per_client)


class _Server(web.Server):
    """aiohttp's low-level server with a bound on connections, in all and per address."""

    def __init__(self, handler: Any, limits: _Limits, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self._admitted: dict[RequestHandler, str] = {}
        #: Connections past their address's bound, answered 429 and closed (counted in all too).
        self.busy = _Limits(limits.total, BUSY_PER_CLIENT)
        self._busy: dict[RequestHandler, str] = {}

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        client = _peer(transport)
        if self.limits.n + self.busy.n < self.limits.total:
            if self.limits.take(client):
                self._admitted[handler] = client
                return
            if self.busy.take(client):
                self._busy[handler] = client
                return
        transport.abort()  # over every bound: closed before a byte is read

    def is_busy(self, handler: RequestHandler | None) -> bool:
        return handler in self._busy

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        client = self._admitted.pop(handler, None)
        if client is not None:
            self.limits.give(client)
        client = self._busy.pop(handler, None)
        if client is not None:
            self.busy.give(client)
        super().connection_lost(handler, exc)


def _peer(transport: asyncio.BaseTransport) -> str:
    peername = transport.get_extra_info("peername")
    return str(peername[0]) if peername else "?"


async def _body(request: web.BaseRequest) -> bytes | web.Response:
    """A POST's body, at most MAX_BODY and within BODY_S; else the answer that says which."""
    if (request.content_length or 0) > MAX_BODY:
        return _error(413, "request too large")
    try:
        async with asyncio.timeout(BODY_S):
            return await request.read()
    except TimeoutError:
        return _error(408, f"the request body did not arrive within {BODY_S:.0f} s")
    except web.HTTPRequestEntityTooLarge:
        return _error(413, "request too large")


def _route(request: web.BaseRequest) -> str:
    """The kind of a request, for the requests metric (a bounded set of values)."""
    path = request.path
    if path.startswith(OBJECTS_PATH):
        return "objects_probe" if f"{PROBE_PARAM}=" in request.query_string else "objects"
    if path.startswith(LISTINGS_PATH):
        return "listings"
    if path == OBJECTS_BATCH_PATH:
        return "objects_batch"
    return {PEERS_PATH: "peers", RESERVE_PATH: "reserve", WIPE_PATH: "wipe", "/metrics": "metrics"}.get(
        path, "healthz" if path == "/healthz" else "other"
    )


#: The key under which an object's 404 answer keeps its ``state`` (staging, absent, unclaimed) for the
#: requests metric (an aiohttp response is a mapping of such values for its handler).
STATE_KEY = web.ResponseKey("dscache_state", str)


def _not_here(state: RevisionState, message: str) -> web.Response:
    """An object's "not here" answer (404 with its ``state``), made without a dict to dump: one of
    these goes with each object served (issue 30: the probes answered "unclaimed")."""
    body = b'{"state": "%s", "error": %s}' % (state.value.encode(), json.dumps(message).encode())
    resp = web.Response(status=404, body=body, content_type="application/json")
    resp[STATE_KEY] = state.value
    return resp


def _json(code: int, body: Any) -> web.Response:
    return web.Response(status=code, text=json.dumps(body), content_type="application/json")


def _peer_of(request: web.BaseRequest) -> str:
    return _peer(request.transport) if request.transport else "?"


def _error(code: int, message: str) -> web.Response:
    return _json(code, {"error": message})


def _bearer(request: web.BaseRequest) -> str:
    return (request.headers.get("Authorization") or "").removeprefix("Bearer ").strip()


class AgentServer:
    """The agent's server on a socket bound at construction; ``serve_forever`` runs its event loop
    in the calling thread until ``shutdown`` (from any thread)."""

    def __init__(
        self, agent: Agent, gate: Gate, port: int, addr: str = "0.0.0.0", tls: ssl.SSLContext | None = None
    ) -> None:
        self.agent = agent
        self.gate = gate
        self.tls = tls
        self.claims = Claims()
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(1024)
        self.server_address = self.sock.getsockname()
        self.connections = _Limits(MAX_CONNECTIONS, MAX_PER_CLIENT)
        self.objects = _Limits(MAX_OBJECTS, OBJECTS_PER_CLIENT)
        self.control = _Pool(CONTROL_THREADS, CONTROL_PER_CLIENT, "agent-call")
        self.checks = _Pool(CHECK_THREADS, CONTROL_PER_CLIENT, "agent-check")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._sending: asyncio.Semaphore | None = None  # made on the loop
        self._arrivals: Arrivals | None = None  # made on the loop
        self._server: _Server | None = None
        self._stopped = threading.Event()
        #: Set by shutdown, whenever it comes: a serve_forever that had not started yet then
        #: returns at once instead of serving a socket server_close is about to close.
        self._shutting_down = threading.Event()
        #: The size of each copy's claims file at the last full look (event loop only).
        self._claims_seen: dict[str, int] = {}
        #: The requests metric's counters by (route, status, state) (event loop only).
        self._counted: dict[tuple[str, int, str], Any] = {}
        #: Token checks in progress (event loop only), by the question they answer.
        self._checks: dict[tuple[str, ...], asyncio.Future[Refusal | None]] = {}

    # --- running ------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        asyncio.run(self._serve())

    def shutdown(self) -> None:
        """Stop serving and wait for it (at most 30 s). Before serve_forever has started its loop,
        it only tells it not to serve (the socketserver's shutdown would wait for ever then)."""
        self._shutting_down.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)
            self._stopped.wait(30)

    def server_close(self) -> None:
        self.control.executor.shutdown(wait=False, cancel_futures=True)
        self.checks.executor.shutdown(wait=False, cancel_futures=True)
        self.sock.close()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._shutting_down.is_set():  # after _loop is set: a later shutdown finds the loop
            self._stopped.set()
            return
        self._sending = asyncio.Semaphore(MAX_SENDING)
        server = _Server(
            self._handle,
            self.connections,
            keepalive_timeout=IDLE_S,
            # The agent's own log line per request would be noise at a peer's object rate.
            access_log=None,
            handler_cancellation=True,
        )
        self._server = server
        runner = web.ServerRunner(server, handle_signals=False)
        await runner.setup()
        site = web.SockSite(runner, self.sock, ssl_context=self.tls)
        await site.start()
        arrivals = self._arrivals = Arrivals(self._loop)
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            arrivals.close()
            self._stopped.set()

    # --- requests -----------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        resp = await self._dispatch(request)
        # Requests by kind and answer (issue 30: where a fan-out's requests go, e.g. how many
        # object requests were answered "not yet" for each one served).
        key = (_route(request), resp.status, resp.get(STATE_KEY, "") if resp.status == 404 else "")
        counter = self._counted.get(key)
        if counter is None:  # labels() per request was a lookup with string work each time
            counter = self._counted[key] = self.agent.metrics.requests.labels(key[0], str(key[1]), key[2])
        counter.inc()
        return resp

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._server is not None and self._server.is_busy(request.protocol):
            busy = _error(429, f"too many connections from {_peer_of(request)}; ask again in a moment")
            busy.force_close()  # this connection was one past the bound: it ends with this answer
            return busy
        try:
            if request.method == "GET":
                if request.path == "/healthz":
                    agent = self.agent
                    stale = time.monotonic() - agent.last_refresh > max(60.0, 6 * agent.s.scan_interval)
                    return web.Response(status=503 if stale else 200, text="stale\n" if stale else "ok\n")
                if request.path == "/metrics":
                    body = generate_latest(self.agent.metrics.registry)
                    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
                if request.path.startswith(OBJECTS_PATH):
                    return await self._object(request)
                if request.path.startswith(LISTINGS_PATH):
                    return await serve_listing(self, request)
            elif request.method == "POST" and request.path == OBJECTS_BATCH_PATH:
                return await self._objects_batch(request)
            elif request.method == "POST" and request.path in (RESERVE_PATH, PEERS_PATH, WIPE_PATH):
                return await self._post(request)
            return _error(404, f"no such path {request.method} {request.path}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never a dropped connection without an answer
            log.warning(f"{request.method} {request.path}: {type(e).__name__}: {e}")
            return _error(500, f"{type(e).__name__}: {e}")

    async def _post(self, request: web.BaseRequest) -> web.Response:
        started = time.monotonic()
        raw = await _body(request)
        if isinstance(raw, web.Response):
            return raw
        text = raw.decode(errors="replace")
        given, path, agent, gate = _bearer(request), request.path, self.agent, self.gate
        work: Callable[[], str]
        check: Callable[[bool], Refusal | None]
        key: tuple[str, ...]
        try:
            if path == WIPE_PATH:
                wipe = WipeRequest.from_json(text)
                check = lambda offline: gate.controller(given, offline)  # noqa: E731
                key = (path, given)
                work = lambda: agent.wipe(wipe).to_json()  # noqa: E731
            elif path == RESERVE_PATH:
                reserve = ReserveRequest.from_json(text)
                ns, cache = reserve.namespace, reserve.cache
                check = lambda offline: gate.consumer(given, ns, cache, True, offline)  # noqa: E731
                key = (path, given, ns, cache)
                work = lambda: agent.reserve(reserve).to_json()  # noqa: E731
            else:
                peers = PeersRequest.from_json(text)
                ns, cache = peers.namespace, peers.cache
                check = lambda offline: gate.consumer(given, ns, cache, True, offline)  # noqa: E731
                key = (path, given, ns, cache)

                def work() -> str:
                    answer = agent.peers(peers)
                    if answer is None:
                        raise _Conflict("no stager here is copying this revision of that cache: no copy to share")
                    return answer.to_json()

        except (ArgsError, UsageError, ValueError, KeyError, TypeError, AttributeError) as e:
            return _error(400, f"bad request: {e}")
        try:
            refused = await self._check(request, key, check, self.control)
            checked = time.monotonic()
            if refused is not None:
                return _error(refused.status, refused.message)
            waits: list[float] = []
            answer = await self._call(request, self.control, work, waits)
            took = time.monotonic() - started
            if took >= SLOW_ANSWER_S:
                # Its stager waits for this answer (10 s at most for the peers question): say where
                # the time went (issue 30: a thread, the token's check, or the work's API calls).
                log.info(
                    f"{path} answered in {took:.1f} s: {checked - started:.1f} s to check the token, "
                    f"{sum(waits):.1f} s waiting for a thread, then {took - (checked - started) - sum(waits):.1f} s"
                )
            return _json_text(200, answer)
        except _Busy as e:
            return _error(429, str(e))
        except (BusyError, _Conflict) as e:
            return _error(409, str(e))
        except (ArgsError, UsageError, ValueError) as e:
            return _error(400, f"bad request: {e}")
        except (ApiError, OSError) as e:
            # E.g. the API server refused to take a warm label off (then nothing was removed): say so,
            # rather than drop the connection without an answer.
            return _error(503, f"{path} failed: {e}")

    async def _check(
        self, request: web.BaseRequest, key: tuple[str, ...], check: Callable[[bool], Refusal | None], pool: _Pool
    ) -> Refusal | None:
        """``check`` from what is known (a cached token: no thread, no API call), else on ``pool``
        (a TokenReview, a pod's GET), once for all the requests that ask the same question
        (``key``) meanwhile: a stager opens up to 64 connections at once with a token the agent has
        not seen, and one per address may use only CONTROL_PER_CLIENT threads (the rest would be
        told "busy"). _Busy, ApiError or OSError when it cannot be told."""
        try:
            return check(True)
        except NeedsApi:
            pass
        pending = self._checks.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._call(request, pool, lambda: check(False)))
            self._checks[key] = pending
            pending.add_done_callback(lambda _: self._checks.pop(key, None))
        return await asyncio.shield(pending)

    async def _call(
        self, request: web.BaseRequest, pool: _Pool, fn: Callable[[], T], waits: list[float] | None = None
    ) -> T:
        """``fn`` on ``pool``, within this address's share of it; ``waits``: how long it waited for a
        thread is appended there."""
        client = _peer(request.transport) if request.transport else "?"
        if not pool.limits.take(client):
            raise _Busy(f"too many requests from {client} in progress; retry")
        try:
            loop = asyncio.get_running_loop()
            if waits is None:
                return await loop.run_in_executor(pool.executor, fn)
            queued = time.monotonic()

            def timed() -> T:
                waits.append(time.monotonic() - queued)
                return fn()

            return await loop.run_in_executor(pool.executor, timed)
        finally:
            pool.limits.give(client)

    async def consumer_gate(
        self, request: web.BaseRequest, route: str, namespace: str, cache: str
    ) -> web.Response | None:
        """The gate of every read a peer makes (objects, listings): a consumer pod's token for
        ``namespace/cache``, checked once per (route, token, cache) at a time; the answer to send
        when it is refused or cannot be told, else None."""
        given = _bearer(request)
        try:
            refused = await self._check(
                request,
                (route, given, namespace, cache),
                lambda offline: self.gate.consumer(given, namespace, cache, False, offline),
                self.checks,
            )
        except _Busy as e:
            return _error(429, str(e))
        except (ApiError, OSError) as e:
            return _error(503, f"cannot check the token: {e}")
        if refused is None:
            return None
        self.agent.metrics.peer_refused.inc()
        return _error(refused.status, refused.message)

    async def admit(self, request: web.BaseRequest, route: str, namespace: str, cache: str) -> str | web.Response:
        """A peer's read (objects, a batch, a listing) let in: its address, holding one of
        ``self.objects``' slots (given back by the caller), or the answer that refuses it."""
        if (refused := await self.consumer_gate(request, route, namespace, cache)) is not None:
            return refused
        client = _peer(request.transport) if request.transport else "?"
        if not self.objects.take(client):
            return _error(429, f"too many peer requests in progress (from {client} or in all); ask another")
        return client

    async def _object(self, request: web.BaseRequest) -> web.StreamResponse:
        """One complete object for a peer's stager, streamed from the page cache (sendfile)."""
        try:
            # The target as sent (a peer's stager quotes it as ObjectRequest.target does): path_qs
            # would build a URL of it per request; parse unquotes, and check_request refuses "..".
            req = ObjectRequest.parse(request.raw_path)
            check_request(req.namespace, req.cache, req.path)
        except (ValueError, ArgsError) as e:
            return _error(400, f"bad request: {e}")
        client = await self.admit(request, OBJECTS_PATH, req.namespace, req.cache)
        if isinstance(client, web.Response):
            return client
        try:
            started = time.monotonic()
            try:
                opened = await self._wait_for(req)
            except NotHere as e:
                return _not_here(e.state, str(e))
            except OSError as e:
                return _error(503, f"cannot read {req.path}: {e}")
            try:
                if opened.size <= SMALL_BODY and not opened.growing:
                    return self._small(req.revision, opened)
                # At most MAX_SENDING bodies at once, first come first served: all the requests
                # of many nodes at once would share the uplink so thin that every body took
                # longer than a stager allows (issue 30: 31 nodes wrote the first one off).
                # A request that finds no turn within its wait hears "not yet", as if in flight.
                assert self._sending is not None
                turn = max(req.wait, MIN_TURN_S) - (time.monotonic() - started)
                try:
                    async with asyncio.timeout(max(turn, MIN_TURN_S)):
                        await self._sending.acquire()
                except TimeoutError:
                    return _not_here(RevisionState.STAGING, f"{req.path}: every sending slot is busy")
                try:
                    if opened.growing:
                        return await self._follow(request, req.revision, opened)
                    return await self._send(request, req.revision, opened)
                finally:
                    self._sending.release()
            finally:
                os.close(opened.fd)
        finally:
            self.objects.give(client)

    async def _objects_batch(self, request: web.BaseRequest) -> web.StreamResponse:
        """Many small objects for a peer's stager in one answer (OBJECTS_BATCH_PATH): each one that
        is whole here now, read into memory, the others' states, never held: a stager asks those
        alone. One request of 32 objects cost the agent what one object cost (issue 30: 100,000 x
        16 KiB through 4 nodes, ~0.25 ms of the agent's CPU per object request, aiohttp's)."""
        raw = await _body(request)
        if isinstance(raw, web.Response):
            return raw
        try:
            req = ObjectsBatchRequest.from_json(raw)
            check_request(req.namespace, req.cache)
        except (ArgsError, ValueError, KeyError, TypeError) as e:
            return _error(400, f"bad request: {e}")
        client = await self.admit(request, OBJECTS_PATH, req.namespace, req.cache)
        if isinstance(client, web.Response):
            return client
        try:
            c = self.agent.c(req.namespace, req.cache)
            frames: list[bytes] = []
            served = 0
            missed: list[int] = []
            for i, path in enumerate(req.paths):
                try:
                    check_request(req.namespace, req.cache, path)
                except ValueError:
                    frames.append(b"400 0 \n")
                    continue
                try:
                    opened = open_object(c, req.revision, path)
                except FileNotFoundError:
                    frames.append(b"")  # its state below
                    missed.append(i)
                    continue
                except OSError:
                    frames.append(b"503 0 \n")
                    continue
                try:
                    if opened.size > BATCH_OBJECT_MAX:
                        frames.append(b"413 0 \n")  # a sending turn of its own: asked alone
                        continue
                    body = os.pread(opened.fd, opened.size, 0)
                finally:
                    os.close(opened.fd)
                if len(body) != opened.size:
                    frames.append(b"503 0 \n")  # shorter than a moment ago: no body, so no wrong one
                    continue
                frames.append(b"200 %d \n%s" % (len(body), body))
                served += len(body)
            if missed:
                await self._batch_states(c, req, missed, frames)
            self.agent.metrics.peer_served.inc(served)
            return web.Response(
                status=200,
                body=b"".join(frames),
                headers={"Content-Type": "application/octet-stream", REVISION_HEADER: req.revision},
            )
        finally:
            self.objects.give(client)

    async def _batch_states(self, c: str, req: ObjectsBatchRequest, missed: list[int], frames: list[bytes]) -> None:
        """The frames of the batch's objects not here at its first look: the revision's state
        looked at once (the lock, the marker), then each object's own look (as a held request's
        first), on the loop when the claims file to read is short, else on a thread."""

        # poll_object raises NotHere for absent and unclaimed, returns it for staging.
        def each() -> list[bytes]:
            try:
                revision = revision_state(c, req.revision, _locked(c))
            except OSError:
                return [b"503 0 \n"] * len(missed)
            out = []
            for i in missed:
                try:
                    got = poll_object(
                        c, req.revision, req.paths[i], _locked, self.claims, True, req.relay, False, revision
                    )
                except NotHere as e:
                    out.append(b"404 0 %s\n" % e.state.value.encode())
                    continue
                except OSError:
                    out.append(b"503 0 \n")
                    continue
                if isinstance(got, Opened):
                    os.close(got.fd)  # placed since the first look: asked alone, at once
                    state = RevisionState.STAGING
                else:
                    state = got.state
                out.append(b"404 0 %s\n" % state.value.encode())
            return out

        if self._look_on_loop(c, req.revision, True):
            got = each()
        else:
            got = await asyncio.get_running_loop().run_in_executor(None, each)
        for i, frame in zip(missed, got, strict=True):
            frames[i] = frame

    async def _wait_for(self, req: ObjectRequest) -> Opened:
        """The object once it is whole, waiting up to ``req.wait`` while a stager here copies it."""
        c = self.agent.c(req.namespace, req.cache)
        deadline = time.monotonic() + req.wait
        loop = asyncio.get_running_loop()
        # Most objects asked for are whole here already: a few openat on the loop, no thread hop
        # (poll_object's first look, without its claims file).
        if (here := _open_now(c, req)) is not None:
            return here
        just_tried = True  # the look just made: the next full look need not open the file again at once
        while True:
            look = (c, req.revision, req.path, _locked, self.claims, req.probe, req.relay, not just_tried)
            just_tried = False
            if self._look_on_loop(c, req.revision, req.probe):
                got = poll_object(*look)
            else:
                # The claims file may be long (a large revision's paths): read off the loop.
                got = await loop.run_in_executor(None, poll_object, *look)
            if isinstance(got, Opened):
                return got
            # Between two full looks (the lock, the revision's state, the claims), only whether
            # the file is there now, when its directory says something was placed in it (or every
            # POLL_S without inotify): no thread hop, no look for nothing (issue 30).
            full = time.monotonic() + FULL_LOOK_S
            while True:
                now = time.monotonic()
                if now >= deadline:
                    raise got
                await self._placed(c, req.revision, req.path, min(full, deadline) - now, req.size > 0)
                if (here := _open_now(c, req)) is not None:
                    return here
                just_tried = True
                if time.monotonic() >= full:
                    break

    async def _placed(self, c: str, revision: str, path: str, most: float, grow: bool = False) -> None:
        """Until something is placed on the way to ``data/<path>`` (its file, or a directory it is
        to be in), or (``grow``) its grow file is created in the revision's tmp/, ``most`` seconds
        at most; POLL_S when that cannot be watched."""
        arrivals = self._arrivals
        nearest = REVISION_DIRS.nearest(c, revision, path) if arrivals is not None and arrivals.working else None
        if nearest is None:
            await asyncio.sleep(min(POLL_S, most))
            return
        assert arrivals is not None
        watched = [nearest]
        if grow:
            try:
                tmp = open_tmp_dir(c, revision)
            except FileNotFoundError:
                pass
            else:
                watched.append((tmp, grow_name(path)))
        expected = []
        there = False
        try:
            for dir_fd, name in watched:
                if (one := arrivals.expect(dir_fd, name)) is None:
                    there = True  # cannot be watched: poll
                    break
                expected.append(one)
                try:
                    # Placed (or created) between the walk and the watch? (Or there and not a file: poll.)
                    os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    there = True
                    break
                except OSError:
                    pass
        finally:
            for dir_fd, _ in watched:
                os.close(dir_fd)
        try:
            if there:
                await asyncio.sleep(min(POLL_S, most))
                return
            await asyncio.wait([fut for fut, _ in expected], timeout=most, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for _, done in expected:
                done()

    def _look_on_loop(self, c: str, revision: str, probe: bool) -> bool:
        """Whether the next full look at ``revision`` reads little enough to be made on the loop
        (LOOP_CLAIMS_BYTES): always without a probe (no claims read), else when the claims file
        is absent, or grew by less than that since the last look (which read it to its end)."""
        if not probe:
            return True
        path = claims_path(c, revision)
        try:
            size = os.lstat(path).st_size  # a size only: Claims opens it safely (no symlink)
        except OSError:
            return True  # no claims: nothing to read
        seen = self._claims_seen.get(path)
        if len(self._claims_seen) >= 1024:
            self._claims_seen.clear()  # copies come and go: forget the old ones
        self._claims_seen[path] = size
        return seen is not None and 0 <= size - seen < LOOP_CLAIMS_BYTES

    def _small(self, revision: str, opened: Opened) -> web.Response:
        """A small object's answer, headers and body in one write (SMALL_BODY). Read on the loop, as
        it was opened there: the page cache's copy of a file this node just wrote or sent."""
        try:
            body = os.pread(opened.fd, opened.size, 0)
        except OSError as e:
            return _error(503, f"cannot read the object: {e}")
        if len(body) != opened.size:
            # Shorter than it was a moment ago (a wipe, a broken disk): no body, so no wrong one.
            return _error(503, "the object changed while it was read")
        self.agent.metrics.peer_served.inc(len(body))
        return web.Response(
            status=200, body=body, headers={"Content-Type": "application/octet-stream", REVISION_HEADER: revision}
        )

    async def _send(self, request: web.BaseRequest, revision: str, opened: Opened) -> web.StreamResponse:
        resp, transport = await _body_start(request, revision, opened.size)
        sent = 0
        try:
            async with asyncio.timeout(READ_GRACE_S + opened.size / MIN_RATE):
                with open(opened.fd, "rb", closefd=False) as f:
                    sent = await asyncio.get_running_loop().sendfile(transport, f, 0, opened.size)
        except TimeoutError:
            log.info(f"a peer at {_peer(transport)} took its object too slowly; connection closed")
        # Short (the file is shorter than it was, or the peer too slow): the peer sees a short body.
        return await self._body_end(resp, transport, sent, opened.size)

    async def _body_end(
        self, resp: web.StreamResponse, transport: asyncio.Transport, sent: int, size: int
    ) -> web.StreamResponse:
        """An object's answer ended: whole, or cut short (the connection closed) if ``sent`` < ``size``."""
        self.agent.metrics.peer_served.inc(sent)
        if sent < size:
            transport.abort()
            return resp
        await resp.write_eof()
        return resp

    async def _follow(self, request: web.BaseRequest, revision: str, opened: Opened) -> web.StreamResponse:
        """A body a stager here is still writing (its grow file), passed on as it grows, under the
        size the peer gave, which checks the whole against the ETag before placing it. The file
        keeps its inode when the stager renames it into place; a stager that gives it up unlinks
        it, and then, or when the file outgrows that size or has no new byte for GROW_STALL_S, the
        connection is closed and the peer sees a short body (it asks again, or another node)."""
        resp, transport = await _body_start(request, revision, opened.size)
        sent = 0
        try:
            async with asyncio.timeout(READ_GRACE_S + opened.size / MIN_RATE):
                last, seen = time.monotonic(), -1
                while sent < opened.size:
                    st = os.fstat(opened.fd)
                    if st.st_size > opened.size:
                        break  # not the object the peer expects
                    have = _written(opened.fd, st.st_size)
                    if have != seen:
                        last, seen = time.monotonic(), have
                    if have - sent >= min(GROW_SEND, opened.size - sent):
                        chunk = os.pread(opened.fd, min(have - sent, GROW_CHUNK), sent)
                        if not chunk:
                            break
                        await resp.write(chunk)
                        sent += len(chunk)
                        continue
                    if st.st_nlink == 0 or time.monotonic() - last > GROW_STALL_S:
                        break  # given up before it was whole, or stalled
                    await asyncio.sleep(GROW_POLL_S)
        except TimeoutError:
            log.info(f"a peer at {_peer(transport)} took its object too slowly; connection closed")
        return await self._body_end(resp, transport, sent, opened.size)


async def _body_start(
    request: web.BaseRequest, revision: str, size: int
) -> tuple[web.StreamResponse, asyncio.Transport]:
    """An object's answer with its headers sent (its revision, ``size`` as its length), and the
    connection its body goes on."""
    resp = web.StreamResponse(
        status=200, headers={"Content-Type": "application/octet-stream", REVISION_HEADER: revision}
    )
    resp.content_length = size
    await resp.prepare(request)
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("the peer went away")
    return resp, transport


def _open_now(c: str, req: ObjectRequest) -> Opened | None:
    """The object if it is whole here, or, to a peer that gave its size, the grow file a stager
    here is still writing it into (passed on as it comes); None if neither is there now."""
    try:
        return open_object(c, req.revision, req.path)
    except FileNotFoundError:
        pass
    return open_growing(c, req.revision, req.path, req.size) if req.size > 0 else None


def _written(fd: int, size: int) -> int:
    """How much of a grow file is written from its start: its GROWN_XATTR while it has one (a
    file sized before its parts land), else its size. An attribute that is no count says nothing
    is known to be there (the file's size would count bytes not written yet)."""
    try:
        value = os.getxattr(fd, GROWN_XATTR)
    except OSError:
        return size
    return int(value) if value.isdigit() else 0


def _json_text(code: int, text: str) -> web.Response:
    return web.Response(status=code, text=text, content_type="application/json")


class _Busy(Exception):
    """Over a bound: answered 429."""


class _Conflict(Exception):
    """Answered 409."""


def make_server(
    agent: Agent, gate: Gate, port: int, addr: str = "0.0.0.0", tls: ssl.SSLContext | None = None
) -> AgentServer:
    """``gate``: who may call what (auth.py); ``tls``: serve TLS with that context (None: plain HTTP)."""
    return AgentServer(agent, gate, port, addr, tls)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """A server context of the agent's serving certificate (the chart's Secret)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx

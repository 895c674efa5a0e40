"""Peer GETs on the native plane (issue 30): the first request for many objects at once.

peers.py asks for one object per blocking http.client call on a Python thread: at 100,000 x
16 KiB on 4 nodes that was 268 s through peers against 118 s from the bucket alone, and more CPU
in the stagers than the bucket path spent. Here the first choice of the peer ranking (the
object's parent in its tree, peers.Peers.chain) is asked for a batch of objects at once, grouped
per peer, by dscache_native.PeerFetcher (native/src/peer.rs): tokio tasks over at most PER_PEER
kept-alive connections per peer, the same request as peers.Peers.take's first (a probe with
relay, held up to RERANK_S), the same checks before anything is written (REVISION_HEADER, the
Content-Length and the body's length against the manifest, the body's MD5 against its plain
ETag), the GIL released while the batch runs.

Only what the batch placed is done here, and two answers are told apart, which sync's native peer
worker follows in further batches as peers.Peers.obtain would: "unclaimed" (the parent's parent,
or the root again after obtain's pause) and "still copying" (404 staging after a held request:
the chain ranked afresh and asked again, each peer's patience per object kept, a hop that held
without sending passed over once a complete copy is up the chain). Everything else goes back to peers.Peers.obtain, whose whole failure policy applies unchanged: a peer's non-200 answer is read by Peers.answered (the
same verdicts, e.g. "unclaimed" to no probe writes it off); wrong revision or length writes the
peer off as take does; a body that does not hash goes to the bucket and Peers.judge as take's
SUSPECT; no connection at all, or no byte within READ_TIMEOUT_S, writes the peer off; a reset or a
closed connection gets no verdict here (obtain tells busy from broken). Multipart ETags (rebuilt
from candidate part sizes in Python), large objects and the early-peer probes stay on peers.py.

The small objects of a call (up to 64 KiB) are asked in one request of the agents' batch path
(dscache_contract.peers.OBJECTS_BATCH_PATH) first: every one whole at the peer now comes in that
answer, each body checked as when asked alone before it is written; "unclaimed" is the probe's
answer as alone; the others (still copying: held alone; absent, refused, too large) are asked
alone at once, as before. An agent without the batch path (404) is asked alone from then on.
(One request per 16 KiB object cost an agent ~0.25 ms of CPU in aiohttp, more than the bytes:
issue 30, 20,000 x 16 KiB on 4 nodes, agents 16 s of CPU, 10 s with batches.) And each object's
outcome comes to ``ask``'s ``placed`` as soon as it is placed, not with the call's slowest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from dscache_contract.peers import AGENT_TLS_NAME, MAX_WAIT_S, PEER_CA_ENV, RELAY_MARK, REVISION_HEADER

from .objects import SMALL_LIMIT
from .peers import MIN_RATE, PER_PEER, READ_TIMEOUT_S, RERANK_S, Obtained, Outcome, Peers
from .switches import env_flag

log = logging.getLogger("dscache-stage")

#: "0" keeps every peer GET on peers.py's threads (the reference path).
ENV = "DSCACHE_NATIVE_PEERS"
#: "0": every object of a native call asked in a request of its own (no batch path).
BATCH_ENV = "DSCACHE_PEER_BATCHES"

#: The most objects asked in one native call (sync's native peer worker groups per peer what is
#: queued when room frees up; the objects in flight stay as many as peers.py's threads).
BATCH = 32

#: A pooled connection idle this long is closed by the stager first: the agents close theirs
#: after IDLE_S (15 s), and a request sent on one the agent is closing is a reset, not an answer.
IDLE_S = 10.0

_MD5 = re.compile(r"^[0-9a-f]{32}$")

#: (key, rel, size, ETag) of one object.
Want = tuple[str, str, int, str]
#: Per item of a native call: (kind, HTTP status or errno, detail); see native/src/peer.rs.
Answer = tuple[str, int, str]


def load(module: ModuleType | None) -> ModuleType | None:
    """dscache_native, if it has the peer fetcher and it is not switched off."""
    if module is None or not hasattr(module, "PeerFetcher"):
        return None
    if not env_flag(ENV, True):
        return None
    return module


def plain(etag: str, size: int) -> bool:
    """Objects the native path takes: small ones whose ETag is a plain MD5 of their bytes."""
    return 0 < size <= SMALL_LIMIT and bool(_MD5.match(etag.strip('"').lower()))


@dataclass
class _Pending:
    """A call of ``NativePeers.ask`` under way: its future, the answers come so far (by index),
    how many are still to come, the temp paths, and who is told of each object placed."""

    done: asyncio.Future[list[Answer]]
    answers: list[Answer | None]
    left: int
    paths: list[str]
    placed: Callable[[int, str], None] | None


class NativePeers:
    """A dscache_native.PeerFetcher for one run, and how its answers feed peers.py's policy."""

    def __init__(self, module: ModuleType, peers: Peers, workers: int = 1) -> None:
        self.peers = peers
        ca = (os.environ.get(PEER_CA_ENV) or "").strip() or None
        self.fetcher: Any = module.PeerFetcher(
            revision_header=REVISION_HEADER,
            ca_pem=ca,
            tls_name=AGENT_TLS_NAME,
            workers=workers,
            per_peer=PER_PEER,
            # As peers.py's socket timeout: a held request answers within MAX_WAIT_S.
            answer_timeout_s=READ_TIMEOUT_S + MAX_WAIT_S,
            read_timeout_s=READ_TIMEOUT_S,
            min_rate=float(MIN_RATE),
            idle_s=IDLE_S,
        )
        # The agents' batch path (OBJECTS_BATCH_PATH) for the small objects of each call: one request
        # for many objects (the native code asks alone what a batch does not carry).
        self.batches = env_flag(BATCH_ENV, True)
        self.placed = 0  # objects this path placed (the rest went back to obtain)
        self.calls = 0  # native calls (batches) made
        # Objects handed to peers.obtain, by why (an answer's kind or status; sync's own reasons).
        self.handed: Counter[str] = Counter()
        self._lock = threading.Lock()  # first() runs on several peer threads at once
        # ask(): the batches started and not yet completed, by id; the loop whose reader drains them.
        self._pending: dict[int, _Pending] = {}
        self._ids = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def route(self, key: str, etag: str, size: int, slow: frozenset[str] = frozenset()) -> list[str]:
        """Where to ask for ``key`` in a batch: its chain now (its parent ... its root; a batch asks
        one hop of it), or [] when it goes to peers.obtain (a multipart ETag, a large object, this
        node's turn, an early probe). ``slow``: hops that held a request for it without sending,
        passed over while a complete copy is up the chain (as obtain does)."""
        if not plain(etag, size) or not self.peers.verifiable(etag, size):
            return []
        return self._chain(key, slow)

    def hops(self, key: str, slow: frozenset[str] = frozenset()) -> int:
        """How many nodes the chain of ``key`` has now (its parent ... its root)."""
        return len(self._chain(key, slow))

    def _chain(self, key: str, slow: frozenset[str]) -> list[str]:
        hops = self.peers.chain(key)
        if slow and (whole := self.peers.complete()) and any(h in whole for h in hops):
            hops = [h for h in hops if h not in slow]
        return hops

    def _items(
        self,
        wants: list[Want],
        tmp: Callable[[], str],
        claim: Callable[[str], None] | None,
        waits: list[float] | None,
    ) -> tuple[list[str], list[tuple[str, int, str, str]]]:
        """The temp paths and the native call's items; the relay claim written first."""
        p = self.peers
        # obtain's relay claim, before the first request: this node's children wait for its copy.
        # One write for the batch (claim adds the last newline).
        if claim is not None:
            claim("\n".join(RELAY_MARK + rel for _, rel, _, _ in wants))
        # An object of GROW_MIN bytes or more goes into its grow file (the native side writes a file
        # so named as its body comes), and the request gives its size: a peer still taking it
        # answers with what it has so far, as it comes (contract: GROW_MIN).
        paths = [p.temp_for(rel, size, tmp) for _, rel, size, _ in wants]
        held = waits or [RERANK_S] * len(wants)
        items = [
            (p.object_request(rel, wait, True, True, size).target(), size, etag, path)
            for (_, rel, size, etag), path, wait in zip(wants, paths, held, strict=True)
        ]
        return paths, items

    def first(
        self, addr: str, wants: list[Want], tmp: Callable[[], str], claim: Callable[[str], None] | None
    ) -> list[Obtained | None]:
        """Ask ``addr`` once for each object, as peers.Peers.obtain's first request would; per
        object PLACED (in its temp file), BUCKET with ``suspect`` (judge it against the bucket's
        copy), UNCLAIMED (the peer neither holds, reads nor takes it: its parent next, or the root
        again after a pause, as peers.obtain would do), WAIT (still copying it after the held
        request: the chain ranked again), or None: peers.obtain takes it from here. Blocking
        (without the GIL); ``ask`` is the event loop's way. ``claim`` None: the objects were
        claimed by an earlier call."""
        paths, items = self._items(wants, tmp, claim, None)
        outcomes = self.fetcher.fetch(addr, self.peers.token(), self.peers.revision, items, self._batch(wants))
        return self._outcomes(addr, wants, paths, outcomes)

    async def ask(
        self,
        addr: str,
        wants: list[Want],
        tmp: Callable[[], str],
        claim: Callable[[str], None] | None,
        waits: list[float] | None = None,
        placed: Callable[[int, str], None] | None = None,
    ) -> list[Obtained | None]:
        """``first`` on the event loop, with no thread waiting: the batch runs on the native
        runtime, which says on a pipe when outcomes come. ``waits``: each request's hold (default
        RERANK_S; less when a peer's patience for the object is nearly spent). ``placed``: called
        on the loop with (index in ``wants``, temp path) for each object placed, as soon as it is,
        not when the call's last object is done: an object held back with a slower one of its call
        (a held request, up to RERANK_S) kept its own children waiting for it, and theirs for
        them (issue 30: calls of 5 s in a row at the end of a 4-node copy of small files)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(self.fetcher.notify_fd(), self._drain)
            self._loop = loop
        paths, items = self._items(wants, tmp, claim, waits)
        self._ids += 1
        batch = self._ids
        done: asyncio.Future[list[Answer]] = loop.create_future()
        self._pending[batch] = _Pending(done, [None] * len(items), len(items), paths, placed)
        try:
            self.fetcher.start(addr, self.peers.token(), self.peers.revision, items, batch, self._batch(wants))
        except BaseException:
            self._pending.pop(batch, None)
            raise
        outcomes = await done
        return self._outcomes(addr, wants, paths, outcomes)

    def _batch(self, wants: list[Want]) -> tuple[str, str, list[str]] | None:
        """The batch path's part of a call: (namespace, cache, each object's path under data/)."""
        if not self.batches or len(wants) < 2:
            return None
        return self.peers.namespace, self.peers.cache, [rel for _, rel, _, _ in wants]

    def _drain(self) -> None:
        """The loop's reader: each outcome come to the call that awaits it (a placed one to its
        ``placed`` at once), and the call's whole list once every object has one."""
        for batch, piece in self.fetcher.completed():
            p = self._pending.get(batch)
            if p is None or p.done.done():  # a cancelled call left its future done
                self._pending.pop(batch, None)
                continue
            try:
                for i, answer in piece:
                    if p.answers[i] is not None:
                        continue
                    p.answers[i] = answer
                    p.left -= 1
                    if answer[0] == "placed" and p.placed is not None:
                        p.placed(i, p.paths[i])
            except BaseException as e:  # placing failed (ENOSPC...): the call fails, the run does
                self._pending.pop(batch, None)
                p.done.set_exception(e)
                continue
            if p.left == 0:
                self._pending.pop(batch, None)
                p.done.set_result([a for a in p.answers if a is not None])

    def _outcomes(
        self, addr: str, wants: list[Want], paths: list[str], outcomes: list[Answer]
    ) -> list[Obtained | None]:
        out: list[Obtained | None] = []
        for (_, rel, _, etag), path, (kind, code, detail) in zip(wants, paths, outcomes, strict=True):
            out.append(self._outcome(addr, rel, etag, path, kind, code, detail))
        with self._lock:
            self.placed += sum(1 for o in out if o is not None and o.outcome is Outcome.PLACED)
            self.calls += 1
        return out

    def _outcome(self, addr: str, rel: str, etag: str, path: str, kind: str, code: int, detail: str) -> Obtained | None:
        p = self.peers
        if kind == "placed":
            return Obtained(Outcome.PLACED, path)
        if kind == "suspect":
            log.info(f"peer {addr}: {rel} does not hash to its ETag {etag}; the bucket's copy decides")
            return Obtained(Outcome.BUCKET, suspect=(addr, detail))
        if kind == "lied":
            p._fail(addr, f"sent bytes that do not match the revision's manifest ({detail})")
        elif kind in ("refused", "stalled"):
            p._fail(addr, f"failed mid-request ({kind}: {detail})")
        elif kind == "status":
            # Its verdict on the peer; obtain asks again, but for "unclaimed" and "still copying"
            # (sync asks natively again).
            if (said := p.answered(addr, rel, code, detail, True)) in (Outcome.UNCLAIMED, Outcome.WAIT):
                return Obtained(said)
        elif kind == "local":
            raise OSError(code, os.strerror(code), detail)
        self.handed[f"{kind} {code}" if kind == "status" else kind] += 1
        return None

    def close(self) -> None:
        """Stop every batch: requests in flight are dropped, nothing more is written."""
        self.fetcher.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.fetcher.notify_fd())
            self._loop = None

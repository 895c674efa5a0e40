"""Fetch once per cluster, the stager's side: take objects from other nodes, verified.

The node agent says who else stages or holds this revision (``PEERS_PATH``; asked
five times a second while the nodes that start together find each other, then every
second). ``dscache_contract.peers.owner_ranking`` orders, per object, the nodes; its
first, the object's root, reads it from the bucket, and every other node takes it
from its parent in the object's tree (``fetch_chain``), so every copy serves on. A
node waits only on a peer that holds, reads or takes the object (a probe; a parent
that does none of these is passed for its own parent), and asks the root again after
a pause rather than read the bucket itself. A peer's
answer is trusted for nothing: the body must have the manifest's size and hash to
the listed ETag (an MD5, or a multipart ETag rebuilt for the usual part sizes)
before it is placed. Objects whose ETag cannot check their bytes (a multipart
ETag of an unusual part size) are never taken from peers; see ``Digest`` for
SSE-KMS.

Failure costs a retry, never a wrong byte:
- a peer that refuses the connection, stalls (no byte for ``READ_TIMEOUT_S``, or a
  body slower than ``MIN_RATE``) or drops it mid-body is skipped for the rest of the
  run; the next node of the ranking is asked, and the bucket when this node's turn
  comes, so a dead peer's objects are read from the bucket by one node each, not by
  every node; so is a peer that breaks the protocol (an "unclaimed" answer to a
  request that was no probe);
- a peer still copying an object is asked again for it only after the ranking was
  computed afresh (``RERANK_S``): the cohort may have changed meanwhile (a node
  completed, a stale label went), and the object's new chain is asked; each peer gets
  ``PATIENCE_S`` per object in all; before the root reads an object, the peers that
  started before it are probed (they may have read it before they knew of it), and one
  that reads it is asked again until it sends it; a peer is no longer probed once it
  said, after ``PROBE_S``, that it does not read one (it knew of this node by then);
- a busy peer (429: its bound for this node) is asked again after ``BUSY_PAUSE_S``, for
  ``BUSY_S`` per object; a kept-alive connection the peer closed while idle is opened
  anew once: neither is a fault, and neither sends the object to the bucket;
- a peer whose bytes do not match is suspected, and the object is fetched from the
  bucket at once. The peer is written off only when the bucket's bytes differ from
  its bytes: a multipart ETag's part size is a guess (a 20 MiB object in 6 MiB parts
  has the part count of 5 MiB parts), and an SSE-KMS ETag is no MD5 at all, so a
  mismatch alone proves nothing against the peer. Once the bucket showed that an
  ETag of some form does not check its bytes, objects with ETags of that form come
  from the bucket for the rest of the run, without asking any peer first.

The requests are blocking http.client calls on a small thread pool, over at most
``PER_PEER`` keep-alive connections per peer, shared by the threads: the agents serve
with sendfile, and a held request (``?wait=``) costs a thread, not the event loop. With the
native plane installed, the first request for most objects (small, plain MD5 ETag, first choice of
the chain) is sent by peer_native.py instead, many objects per call on tokio tasks (the small
ones of a call in one request of the agents' batch path), with the same checks before a byte is
written; an "unclaimed" answer is followed there as ``obtain`` follows it
(the parent's parent at once, the root again after ``ROOT_PAUSE_S`` doubling), and what it does not
place otherwise comes here, where every rule above applies.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from dscache_contract.peers import (
    COHORT_WINDOW_S,
    GROW_MIN,
    GROW_PREFIX,
    MAX_WAIT_S,
    PEERS_PATH,
    RELAY_MARK,
    REVISION_HEADER,
    ObjectRequest,
    PeersAnswer,
    PeersRequest,
    RevisionState,
    fetch_chain,
    grow_name,
    owner_ranking,
)

from . import agentcall, agenttls, trace
from .fetch import FILE_MODE
from .switches import env_flag

log = logging.getLogger("dscache-stage")

#: "0" turns off passing large objects on as they come (GROW_MIN): each is passed on once whole.
GROW_ENV = "DSCACHE_GROW"
#: A peer that sends no byte for this long is taken for stalled.
READ_TIMEOUT_S = 30.0
#: A body slower than this (after READ_TIMEOUT_S of grace) is a stalled peer too: one byte every
#: few seconds would otherwise hold a worker for as long as the peer likes.
MIN_RATE = 1 << 20
#: The longest this node waits for one peer still copying one object, in all.
PATIENCE_S = 180.0
#: How long one held request for an object in flight lasts; then the ranking is computed afresh.
RERANK_S = 5.0
#: A busy peer (429: its bound for this node's connections or requests) is asked again after this
#: pause, for up to BUSY_S per object; only then does the object go to the next node or the bucket
#: (a busy peer is no wrong one: reading the bucket instead fetches the object twice).
BUSY_PAUSE_S = 0.25
BUSY_S = 20.0
#: How often the node agent is asked again who the peers are. A node that started before this one
#: learns of it within this long (and the agent's ANSWER_TTL_S); until then it may read objects now
#: ranked to this one, which is why this node asks such earlier peers whether they read one of its
#: objects, and takes their "no" for an answer only ``PROBE_S`` after its start (longer than this).
REFRESH_S = 1.0
PROBE_S = 2.0
#: The same for a peer still in its first seconds (it asks EARLY_REFRESH_S apart).
JOINED_S = 1.0
#: While the nodes that start together find each other (COHORT_WINDOW_S and a second more), the
#: agent is asked this often.
EARLY_REFRESH_S = 0.2
#: An object's root that has not come to it yet is asked again after this pause, doubling up to
#: a quarter second (each node reads its share in listing order, as the others ask for it).
ROOT_PAUSE_S = 0.05
ROOT_PAUSE_MAX_S = 0.25
#: Connections (requests at once) to one peer: an agent sends MAX_SENDING bodies at once anyway,
#: and takes MAX_CONNECTIONS in all (31 peers x 12 fit in 512).
PER_PEER = 12
#: The token file is read again this often (the kubelet renews the projected token in place).
TOKEN_TTL_S = 30.0
CHUNK = 1 << 20
#: Chains kept per answer (Peers.chain): a few MB at most; past it they are computed afresh.
CHAINS_KEPT = 1 << 16

_MD5 = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART = re.compile(r"^([0-9a-f]{32})-([0-9]+)$")
MiB = 1 << 20
#: Part sizes of the common uploaders (boto3 and the AWS CLI: 8 MiB; others 5-64 MiB and more).
PART_SIZES = tuple(n * MiB for n in (8, 5, 16, 10, 15, 32, 64, 50, 100, 128, 256, 512))


class Outcome(Enum):
    PLACED = "placed"  # verified, in the temp file
    NEXT = "next"  # not there (any more), or busy: ask the next in the ranking
    WAIT = "wait"  # the peer is still copying it: rank again, then ask the first choice
    BUSY = "busy"  # the peer is over its bound for this node (429): ask it again in a moment
    SUSPECT = "suspect"  # the bytes did not hash to the ETag: the bucket's copy decides who was wrong
    BUCKET = "bucket"  # this node's turn: read the bucket
    UNCLAIMED = "unclaimed"  # a probe's answer: the peer neither has it nor reads (or takes) it now


@dataclass(frozen=True)
class Obtained:
    """What ``Peers.obtain`` got: PLACED (in ``tmp``) or BUCKET; ``suspect``: the peer and the MD5
    of the body it sent, when that body did not hash to the ETag (``judge`` it against the
    bucket's copy)."""

    outcome: Outcome
    tmp: str = ""
    suspect: tuple[str, str] | None = None


def etag_form(etag: str) -> str:
    """``md5`` or ``multipart-<N>``: the objects whose ETags one bucket makes alike."""
    etag = etag.strip('"').lower()
    m = _MULTIPART.match(etag)
    return f"multipart-{m.group(2)}" if m else "md5"


def part_sizes(etag: str, size: int) -> tuple[int, ...] | None:
    """How the listed ETag can check a body: () for a plain MD5, the candidate part sizes of a
    multipart ETag (``md5(part md5s)-N``), None when it cannot (an unknown part size; SSE-C)."""
    if size <= 0:
        return None
    etag = etag.strip('"').lower()
    if _MD5.match(etag):
        return ()
    m = _MULTIPART.match(etag)
    if m is None:
        return None
    n = int(m.group(2))
    if n == 1:
        return (size,)  # one part: any part size at least the object's gives the same digest
    fits = tuple(p for p in PART_SIZES if -(-size // p) == n)
    return fits or None


def verifiable(etag: str, size: int) -> bool:
    return part_sizes(etag, size) is not None


class Digest:
    """Hashes a body the way its listed ETag was made, to check that the body is that object.

    Objects encrypted with SSE-KMS have an ETag that looks like an MD5 but is not one: their
    bodies never match, so they are taken from the bucket (and the peer that sent one is not
    asked again): slower, never wrong."""

    def __init__(self, etag: str, size: int) -> None:
        self.want = etag.strip('"').lower()
        # The body's own MD5, whatever the ETag: what the bucket's copy is compared with.
        self.body = hashlib.md5(usedforsecurity=False)
        sizes = part_sizes(etag, size) or ()
        self.plain = not sizes
        # Per candidate part size: (part size, digests of the parts done, current part's hash, its length)
        self.parts = [(p, list[bytes](), hashlib.md5(usedforsecurity=False), 0) for p in sizes]

    def update(self, chunk: bytes | memoryview) -> None:
        self.body.update(chunk)
        if self.plain:
            return
        view = memoryview(chunk)
        for i, (p, done, cur, fill) in enumerate(self.parts):
            at = 0
            while at < len(view):
                take = min(p - fill, len(view) - at)
                cur.update(view[at : at + take])
                at, fill = at + take, fill + take
                if fill == p:
                    done.append(cur.digest())
                    cur, fill = hashlib.md5(usedforsecurity=False), 0
            self.parts[i] = (p, done, cur, fill)

    def matches(self) -> bool:
        if self.plain:
            return self.body.hexdigest() == self.want
        for _, done, cur, fill in self.parts:
            digests = done + ([cur.digest()] if fill else [])
            got = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{len(digests)}"
            if got == self.want:
                return True
        return False


class Peers:
    """This node's view of the other nodes of its revision, and the client that asks them."""

    def __init__(self, agent: str, cache: str, revision: str, token_file: str) -> None:
        self.namespace, self.cache = cache.split("/", 1)
        self.revision = revision
        self.token_file = token_file
        self.answer: PeersAnswer | None = None
        #: Whether the first question was asked again after a timeout (ask_agent: once per run).
        self._retried = False
        # Peers no longer asked in this run, and why (each is logged once).
        self.failed: dict[str, str] = {}
        self._token: tuple[float, str] = (0.0, "")
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._all: list[http.client.HTTPConnection] = []
        # The connection to this node's agent, kept alive between questions (one thread asks).
        # Asked five times a second while the cohort forms, then every second: one kept connection.
        self._agent = agentcall.AgentConnection(agent, 10)
        # ETag forms (etag_form) that the bucket showed do not check their bytes (SSE-KMS, a
        # multipart ETag of an unusual part size): objects with them are not asked of peers.
        self.unverifiable: set[str] = set()
        # Earlier peers that answered, after PROBE_S, that they do not read an object ranked to this
        # node: they know of it, and read none of its objects from now on (early_peers).
        # Per such peer, the first key (in listing order) it said so about: it claims in listing
        # order, so it read nothing of this node's from there on; keys before may be claimed.
        self.early_done: dict[str, str] = {}
        # chain(key) without skips, per key, for one answer and one set of failed peers: the ranking
        # (seven SHA-256 and two sorts on 4 nodes) was a tenth of the stager's Python time with
        # peers, computed two or three times per object (issue 30, 20,000 x 16 KiB on 4 nodes).
        self._chains: tuple[PeersAnswer | None, int, dict[str, list[str]] | None] = (None, 0, None)
        # GROW_MIN's way for large objects, unless switched off (GROW_ENV).
        self._grow = env_flag(GROW_ENV, True)

    def grows(self, size: int) -> bool:
        """Whether an object of ``size`` bytes is passed on as it comes (dscache_contract.peers.GROW_MIN):
        written into its grow file as its body comes here, and asked of peers with its size."""
        return self._grow and size >= GROW_MIN

    def object_request(self, rel: str, wait: float, probe: bool, relay: bool, size: int) -> ObjectRequest:
        """A request for ``rel`` of this revision; with its size when it grows (a peer still taking
        it then answers as it comes)."""
        return ObjectRequest(
            self.namespace, self.cache, self.revision, rel, wait, probe, relay, size if self.grows(size) else 0
        )

    def temp_for(self, rel: str, size: int, tmp: Callable[[], str]) -> str:
        """The temp file to take ``rel`` into from a peer: its grow file (in the same tmp/) when it
        grows, for this node's agent to pass on as it comes; else a new one of ``tmp``."""
        path = tmp()
        return os.path.join(os.path.dirname(path), grow_name(rel)) if self.grows(size) else path

    # --- who -----------------------------------------------------------------------------

    def token(self) -> str:
        at, text = self._token
        if time.monotonic() - at > TOKEN_TTL_S:
            try:
                with open(self.token_file) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            self._token = (time.monotonic(), text)
        return text

    def ask_agent(self) -> PeersAnswer | None:
        """Ask the node's agent (this also publishes this node as staging the revision).
        None: the agent did not answer (then this node reads the bucket for everything)."""
        body = PeersRequest(self.namespace, self.cache, self.revision).to_json()
        token = self.token()
        if not token:
            return None  # the agent publishes nothing for a stager that cannot show the cache's token
        try:
            try:
                text = self._agent.post(PEERS_PATH, body, token)
            except TimeoutError as e:
                if self.answer is not None or self._retried:
                    raise
                # A safety net (issue 30): an agent that took longer than the timeout to answer the
                # first question (its Node's label, its views' lists, on an API server busy with a
                # cohort's start) answers a second one from memory. Without an answer this node
                # would read every object from the bucket until a later question is answered.
                self._retried = True
                log.debug(f"peers: the agent did not answer at once ({e}); asking once more")
                text = self._agent.post(PEERS_PATH, body, token, timeout=agentcall.FIRST_RETRY_S)
            answer = PeersAnswer.from_json(text)
        except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as e:
            log.debug(f"peers: the agent did not answer: {e}")
            return None
        if not answer.me:
            return None  # the agent does not know its own address: no peer could reach us either
        if answer != self.answer:  # the same answer keeps its object (and the rankings kept for it)
            self.answer = answer
        return self.answer

    def others(self) -> list[str]:
        a = self.answer
        if a is None:
            return []
        return [p.addr for p in (*a.staging, *a.complete) if p.addr != a.me]

    def verifiable(self, etag: str, size: int) -> bool:
        """Whether a peer's body of this object can be checked (else it comes from the bucket)."""
        return verifiable(etag, size) and etag_form(etag) not in self.unverifiable

    def ahead_of_me(self, key: str, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """The live peers ranked before this node for ``key`` ([]: its own turn to read the bucket);
        ``skip``: peers not to ask for this object again (they said no, or were busy)."""
        a = self.answer
        if a is None or not self.token():
            return []
        out = []
        for addr in owner_ranking(key, a):
            if addr == a.me:
                break
            if addr not in self.failed and addr not in skip:
                out.append(addr)
        return out

    def chain(self, key: str, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Where to take ``key`` from: this node's parent in the object's tree, its parent, ... up
        to the object's root (contract ``fetch_chain``), over the live peers; [] when this node is
        the root (its turn to read the bucket)."""
        a = self.answer
        if a is None or not self.token():
            return []
        if skip:
            return self._chain(a, key, skip)
        memo_answer, memo_failed, memo = self._chains
        if memo_answer is not a or memo_failed != len(self.failed) or (memo is not None and len(memo) >= CHAINS_KEPT):
            # Only a ranking that cannot change with the clock is kept: owner_ranking places a node
            # missing from the answer's staging as starting now.
            memo = {} if any(p.addr == a.me for p in a.staging) else None
            self._chains = (a, len(self.failed), memo)
        if memo is None:
            return self._chain(a, key, skip)
        hops = memo.get(key)
        if hops is None:
            hops = memo[key] = self._chain(a, key, skip)
        return list(hops)

    def _chain(self, a: PeersAnswer, key: str, skip: frozenset[str] | set[str]) -> list[str]:
        order = [x for x in owner_ranking(key, a) if x == a.me or (x not in self.failed and x not in skip)]
        return fetch_chain(key, order, a.me)

    def early_peers(self, key: str = "") -> list[str]:
        """Peers that may have read objects now ranked to this node before they knew of it: those
        that started before it, or less than ``PROBE_S`` after it (their first answer may have
        come before this node's label showed). Before this node reads such an object from the
        bucket it asks them (a probe: only if they read it) first. Once such a peer said that it
        does not read one, asked when it surely knew of this node (``_until_known``), it is left
        out for that key and every key listed after it: it decides its objects in listing order.
        (Left out for every key, it was not asked about an earlier key it had read before it knew
        of this node, while this node's threads asked about later ones first: read twice.)"""
        a = self.answer
        if a is None or not self.token():
            return []
        mine = self._since(a.me)
        if not mine:
            return []
        return [
            p.addr
            for p in a.staging
            if p.since < mine + PROBE_S
            and p.addr != a.me
            and p.addr not in self.failed
            and not (p.addr in self.early_done and key >= self.early_done[p.addr])
        ]

    def _since(self, addr: str) -> float:
        """When ``addr``'s copy started (0: unknown)."""
        a = self.answer
        return next((p.since for p in a.staging if p.addr == addr), 0.0) if a else 0.0

    def complete(self) -> set[str]:
        """The peers that hold the revision whole."""
        a = self.answer
        return {p.addr for p in a.complete} if a else set()

    def to_peers(self, key: str) -> bool:
        """Whether ``key`` is asked of the peers before the bucket (else: this node reads it now)."""
        return bool(self.chain(key) or self.early_peers(key))

    def _until_known(self, addr: str, asked_at: float) -> float:
        """Seconds from ``asked_at`` (epoch) until ``addr`` surely knows of this node; 0: it did
        then. One that started later had this node in its second answer at the latest: within
        ``JOINED_S`` of its start (it asks EARLY_REFRESH_S apart then). One that started earlier
        learns of this node at its next refresh: EARLY_REFRESH_S apart while it is in its own
        first seconds, else REFRESH_S, hence ``PROBE_S``. (Waiting PROBE_S after the later start
        in all cases cost the 3 nodes that start together 1.2 s of 5.)"""
        mine, theirs = self._since(self.answer.me if self.answer else ""), self._since(addr)
        if not mine or not theirs:
            return 0.0
        if theirs >= mine:
            known = theirs + JOINED_S
        elif mine < theirs + COHORT_WINDOW_S + 1.0:
            known = mine + JOINED_S
        else:
            known = mine + PROBE_S
        return max(0.0, known - asked_at)

    def _early_answered(self, addr: str, asked_at: float, key: str) -> None:
        """``addr`` did not read an object ranked to this node, asked at ``asked_at`` (epoch)."""
        if not self._until_known(addr, asked_at) and self._since(addr) and self._its_own(addr, key):
            with self._lock:
                self.early_done[addr] = min(self.early_done.get(addr, key), key)

    def _its_own(self, addr: str, key: str) -> bool:
        """Whether ``addr`` ranks itself first for ``key`` among every node it can have known of
        before this one (the others of this node's answer): had it come to ``key`` before it knew
        of this node, it would have read it. Only then does its "no" say that it had not come to
        ``key`` when it learnt of this node, and so read none of this node's objects listed after
        it. A "no" for a key it ranked to a third node says nothing of the keys after (a first
        node that read the bucket sooner had read 21 of them at N = 8, bench/fanout.py, each read
        again by the node it was ranked to)."""
        a = self.answer
        if a is None:
            return False
        view = PeersAnswer(me=addr, staging=[p for p in a.staging if p.addr != a.me], complete=a.complete)
        return owner_ranking(key, view)[:1] == [addr]

    def _fail(self, addr: str, why: str) -> None:
        with self._lock:
            if addr not in self.failed:
                self.failed[addr] = why
                log.warning(f"peer {addr}: {why}; not asked again (its objects come from the next node or the bucket)")

    def judge(self, addr: str, peer_md5: str, etag: str, path: str) -> None:
        """After a suspect body from ``addr`` (its MD5 ``peer_md5``), the bucket's copy of the object
        at ``path`` decides: other bytes, the peer lied (never asked again); the same bytes, the
        ETag cannot check them (SSE-KMS, an unusual part size), and objects with ETags of its form
        come from the bucket from now on. Blocking (reads the object once)."""
        h = hashlib.md5(usedforsecurity=False)
        try:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
        except OSError as e:
            log.debug(f"peers: cannot read {path} back to judge {addr}: {e}")
            return
        if h.hexdigest() != peer_md5:
            self._fail(addr, "sent bytes that do not match the revision's manifest (nor the bucket's copy)")
            return
        form = etag_form(etag)
        with self._lock:
            if form not in self.unverifiable:
                self.unverifiable.add(form)
                log.warning(
                    f"peers: ETags like {etag} do not check their objects' bytes here (SSE-KMS, or multipart "
                    f"parts of an unusual size); such objects come from the bucket for the rest of this copy"
                )

    # --- taking an object ----------------------------------------------------------------

    def obtain(
        self,
        key: str,
        rel: str,
        size: int,
        etag: str,
        tmp: Callable[[], str],
        claim: Callable[[str], None] = lambda line: None,
        patience: dict[str, float] | None = None,
        slow_hops: frozenset[str] = frozenset(),
    ) -> Obtained:
        """Take ``key`` (``rel`` under data/) from the peers, verified, into a temp file ``tmp()``
        makes up; BUCKET when this node is the object's root. Up the object's tree (``chain``): a
        peer is waited on only while it holds, reads or takes the object (a probe with ``relay``);
        one that does none of these is passed for its parent, and the root, which will read it, is
        asked again after a pause. Before the first request ``claim`` gets the claims line saying
        that this node takes the object from a peer (its own children then wait for it). The
        ranking is computed afresh after each held request; each peer gets PATIENCE_S per object
        in all; one that says no is not asked for this object again. ``patience`` and ``slow_hops``:
        what the native peer worker's requests for it spent and saw (per peer, when its patience
        for the object ends; the hops that held a request for it without sending). Blocking: a worker thread."""
        skip: set[str] = set()
        patience = dict(patience or {})
        busy: dict[str, float] = {}
        pause = ROOT_PAUSE_S
        relayed = False
        # Earlier peers whose probe said they read it from the bucket: asked again until they send it
        # (reading it from the bucket too would fetch it twice: e2e/test_40 measured 1.14-1.23x).
        reading: list[str] = []
        probed: set[str] = set()
        # Hops that held a request without sending: passed over when a complete copy is up the chain.
        slow: set[str] = set(slow_hops)
        while True:
            hops = self.chain(key, skip)
            if slow and (whole := self.complete()) and any(h in whole for h in hops):
                hops = [h for h in hops if h not in slow]
            if not hops:
                # This node is the root: unless an earlier peer reads it already, its turn.
                if held := [p for p in reading if p not in skip and p not in self.failed]:
                    hops, relay = [held[0]], False
                elif early := [p for p in self.early_peers(key) if p not in probed and p not in skip]:
                    hops, relay = [early[0]], False
                    probed.add(early[0])
                else:
                    return Obtained(Outcome.BUCKET)
            else:
                relay = True
                if not relayed:
                    claim(RELAY_MARK + rel)
                    relayed = True
            for i, addr in enumerate(hops):
                last = i == len(hops) - 1
                now = time.monotonic()
                deadline = patience.setdefault(addr, now + PATIENCE_S)
                if now >= deadline:
                    self._fail(addr, f"has not copied {rel} in {PATIENCE_S:.0f} s (stalled)")
                    break
                asked_at, path = time.time(), self.temp_for(rel, size, tmp)
                outcome, md5 = self.take(addr, rel, size, etag, path, True, min(RERANK_S, deadline - now), relay)
                if trace.ON:
                    trace.mark(f"obj-py {outcome.value} {addr} {rel} h{i}", trace.ms_since(now))
                if outcome is Outcome.PLACED:
                    return Obtained(outcome, path)
                if outcome is Outcome.SUSPECT:
                    return Obtained(Outcome.BUCKET, suspect=(addr, md5))
                if outcome is Outcome.UNCLAIMED:
                    if not relay:
                        # An earlier peer that does not read it. Within PROBE_S of this node's start
                        # it may not know of this node yet, and read it a moment later: ask again
                        # once PROBE_S is over (it knows of this node then), and only then is it
                        # this node's turn. (Asked once, a node paced behind the first read 1.3x.)
                        if (wait := self._until_known(addr, asked_at)) > 0:
                            probed.discard(addr)
                            time.sleep(wait)
                        else:
                            self._early_answered(addr, asked_at, key)
                        break
                    if not last:
                        continue  # a parent not there yet: its parent
                    # The root has not come to it yet: ask again in a moment (not the bucket: that
                    # would read it twice).
                    time.sleep(pause * (0.5 + random.random()))
                    pause = min(pause * 2, ROOT_PAUSE_MAX_S)
                    break
                if outcome is Outcome.BUSY:
                    if not last:
                        continue  # busy: a node higher up has it too, or will
                    if time.monotonic() >= busy.setdefault(addr, time.monotonic() + BUSY_S):
                        skip.add(addr)
                    else:
                        # jitter: the stagers of a node do not all ask again at once
                        time.sleep(BUSY_PAUSE_S * (0.5 + random.random()))
                    break
                if outcome is Outcome.NEXT:
                    skip.add(addr)
                    break
                # WAIT: it holds a claim; rank again (the answer is refreshed every REFRESH_S) and ask.
                if not relay and addr not in reading:
                    reading.append(addr)
                if not last:
                    slow.add(addr)
                break

    def take(
        self,
        addr: str,
        rel: str,
        size: int,
        etag: str,
        tmp: str,
        probe: bool = False,
        wait: float = RERANK_S,
        relay: bool = False,
    ) -> tuple[Outcome, str]:
        """One request for ``rel`` to ``addr``, into ``tmp`` (created, FILE_MODE), verified; held up to
        ``wait`` seconds while the peer is still copying it (``probe``: only if it has it now, or is
        reading it; ``relay``: or taking it from a peer). The second item: the MD5 of a SUSPECT body.
        Blocking."""
        req = self.object_request(rel, max(0.0, min(wait, MAX_WAIT_S)), probe, relay, size)
        try:
            status, state = self._get(addr, req, size, etag, tmp)
        except _Busy:
            return Outcome.BUSY, ""
        except _Suspect as e:
            log.info(f"peer {addr}: {rel} does not hash to its ETag {etag}; the bucket's copy decides")
            return Outcome.SUSPECT, e.md5
        except _Lied as e:
            self._fail(addr, f"sent bytes that do not match the revision's manifest ({e})")
            return Outcome.NEXT, ""
        except _Local as e:
            raise e.__cause__ or e from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            self._fail(addr, f"failed mid-request ({type(e).__name__}: {e})")
            return Outcome.NEXT, ""
        if status == 200:
            return Outcome.PLACED, ""
        return self.answered(addr, rel, status, state, probe), ""

    def answered(self, addr: str, rel: str, status: int, state: str, probe: bool) -> Outcome:
        """What a peer's answer other than 200 means (``state``: its 404 body's); shared with the
        native path (peer_native.py), which sends the same requests."""
        if status == 404 and state == RevisionState.UNCLAIMED:
            if probe:
                return Outcome.UNCLAIMED  # nobody there reads it (yet)
            # Only a probe may be answered so: a peer that says it to a plain request would be asked
            # again and again (a bug, another version, or a stall on purpose).
            self._fail(addr, f"answered 'unclaimed' for {rel} to a request that was no probe")
            return Outcome.NEXT
        if status == 404 and state == RevisionState.STAGING:
            return Outcome.WAIT
        if status == 429:
            return Outcome.BUSY  # over its bound for this node now: asked again in a moment
        if status == 503:
            return Outcome.NEXT  # cannot read it now: the next one for this object, asked again for others
        if status in (401, 403):
            self._fail(addr, f"refused this pod's token (HTTP {status})")
        elif status == 404:
            self._fail(addr, f"neither holds nor copies revision {self.revision} (any more)")
        else:
            self._fail(addr, f"answered HTTP {status}")
        return Outcome.NEXT

    def _new_conn(self, addr: str) -> http.client.HTTPConnection:
        host, _, port = addr.rpartition(":")
        # A held request answers within MAX_WAIT_S; past that, and between two reads of a body,
        # silence means a stalled peer.
        conn = agenttls.connection(host.strip("[]"), int(port), READ_TIMEOUT_S + MAX_WAIT_S)
        with self._lock:
            self._all = [c for c in self._all if c.sock is not None]
            self._all.append(conn)
        return conn

    def _acquire(self, addr: str) -> http.client.HTTPConnection:
        """One of at most PER_PEER connections to ``addr`` (waits for one to be free): the peer
        threads share them, so a node keeps PER_PEER connections to a peer, not one per thread
        (an agent took 16 nodes x 64 threads for a flood, and reset them: issue 30)."""
        with self._lock:
            pool = self._pools.get(addr)
            if pool is None:  # not setdefault: it would build a _Pool (a semaphore) on every call
                pool = self._pools[addr] = _Pool()
        pool.free.acquire()
        with self._lock:
            if pool.idle:
                return pool.idle.pop()
        return self._new_conn(addr)

    def _release(self, addr: str, conn: http.client.HTTPConnection, reuse: bool) -> None:
        pool = self._pools[addr]
        if reuse and conn.sock is not None:
            with self._lock:
                pool.idle.append(conn)
        else:
            conn.close()
        pool.free.release()

    def close(self) -> None:
        """End every request in flight (a failed run must not wait for held requests to time out)."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _get(self, addr: str, req: ObjectRequest, size: int, etag: str, tmp: str) -> tuple[int, str]:
        conn = self._acquire(addr)
        ok = False
        try:
            out = self._ask(addr, conn, req, size, etag, tmp)
            conn = out[2]
            ok = True
            return out[0], out[1]
        finally:
            self._release(addr, conn, ok)

    def _ask(
        self, addr: str, conn: http.client.HTTPConnection, req: ObjectRequest, size: int, etag: str, tmp: str
    ) -> tuple[int, str, http.client.HTTPConnection]:
        path = req.target()
        reused = conn.sock is not None
        if reused:
            conn.sock.settimeout(READ_TIMEOUT_S + MAX_WAIT_S)  # _receive shortened it for a body
        try:
            try:
                conn.request("GET", path, headers={"Authorization": f"Bearer {self.token()}"})
                resp = conn.getresponse()
            except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, http.client.RemoteDisconnected):
                if not reused:
                    # A new connection reset before any answer: the agent is over its bound of
                    # connections (it resets those past the ones it answers 429); a dead one
                    # refuses the connection. Busy, not faulty.
                    raise _Busy() from None
                # A kept-alive connection the peer closed while it was idle (its server closes idle
                # ones after a while): no fault of the peer, and no byte of an answer was read.
                # Once more on a new connection; only a failure there writes the peer off.
                conn.close()
                conn = self._new_conn(addr)
                try:
                    conn.request("GET", path, headers={"Authorization": f"Bearer {self.token()}"})
                    resp = conn.getresponse()
                except (ConnectionResetError, http.client.RemoteDisconnected):
                    raise _Busy() from None
            if resp.status != 200:
                text = resp.read().decode(errors="replace")  # whole: the connection is reused
                state = ""
                if resp.status == 404 and '"state"' in text:
                    state = str(json.loads(text).get("state", ""))
                return resp.status, state, conn
            if resp.getheader(REVISION_HEADER) != self.revision:
                raise _Lied(f"it answered for revision {resp.getheader(REVISION_HEADER)!r}")
            length = int(resp.getheader("Content-Length") or -1)
            if length != size:
                resp.close()
                raise _Lied(f"{length} bytes where the manifest says {size}")
            self._receive(conn, resp, size, etag, tmp)
            return 200, "", conn
        except BaseException:
            conn.close()  # a new one in its place, if it was replaced (the caller closes the first)
            raise

    def _receive(
        self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, size: int, etag: str, tmp: str
    ) -> None:
        digest = Digest(etag, size)
        # The whole body within READ_TIMEOUT_S plus its size at MIN_RATE: each read waits at most
        # what is left of that (a byte now and then does not keep a worker forever).
        deadline = time.monotonic() + READ_TIMEOUT_S + size / MIN_RATE
        if os.path.basename(tmp).startswith(GROW_PREFIX):
            _unlink(tmp)  # a grow file an earlier attempt of this node left (each object has one name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        except OSError as e:
            raise _Local() from e
        try:
            got = 0
            with os.fdopen(fd, "wb", closefd=False) as out:
                while got < size:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"{got} of {size} bytes in {READ_TIMEOUT_S + size / MIN_RATE:.0f} s")
                    if conn.sock is not None:
                        conn.sock.settimeout(min(READ_TIMEOUT_S, left))
                    chunk = resp.read1(min(CHUNK, size - got))  # what one recv gives: the deadline is checked between
                    if not chunk:
                        raise http.client.IncompleteRead(b"", size - got)
                    digest.update(chunk)
                    try:
                        out.write(chunk)
                    except OSError as e:
                        raise _Local() from e
                    got += len(chunk)
            resp.read()  # b"": marks the response done (read1 does not), so the connection is reused
            if not digest.matches():
                raise _Suspect(digest.body.hexdigest())
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)


class _Busy(Exception):
    """A new connection reset before any answer: the peer's agent is over its bound."""


@dataclass
class _Pool:
    """The connections to one peer: at most PER_PEER at once, the idle ones kept alive."""

    free: threading.BoundedSemaphore = field(default_factory=lambda: threading.BoundedSemaphore(PER_PEER))
    idle: list[http.client.HTTPConnection] = field(default_factory=list)


class _Lied(Exception):
    """The peer's answer contradicts the manifest."""


class _Suspect(Exception):
    """The body does not hash to the ETag: a lie, or an ETag that cannot check it (judge)."""

    def __init__(self, md5: str) -> None:
        super().__init__(md5)
        self.md5 = md5


class _Local(OSError):
    """Writing our own temp file failed (ENOSPC...): the run's error, not the peer's."""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

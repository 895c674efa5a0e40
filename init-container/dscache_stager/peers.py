"""Fetch once per cluster, the stager's side: take objects from other nodes, verified.

The node agent says who else stages or holds this revision (``PEERS_PATH``; asked
again every second, so nodes that start together find each other within one).
``dscache_contract.peers.owner_ranking`` orders, per object, the nodes to take it
from; this node reads the bucket when its own turn comes, and only then. A peer's
answer is trusted for nothing: the body must have the manifest's size and hash to
the listed ETag (an MD5, or a multipart ETag rebuilt for the usual part sizes)
before it is placed. Objects whose ETag cannot check their bytes (a multipart
ETag of an unusual part size) are never taken from peers; see ``Digest`` for
SSE-KMS.

Failure costs a retry, never a wrong byte:
- a peer that refuses the connection, stalls (no byte for ``READ_TIMEOUT_S``) or
  drops it mid-body is skipped for the rest of the run; the next node of the
  ranking is asked, and the bucket when this node's turn comes, so a dead peer's
  objects are read from the bucket by one node each, not by every node;
- a peer whose bytes do not match is never asked again, and the object is fetched
  from the bucket at once.

The requests are blocking http.client calls on a small thread pool (one keep-alive
connection per peer and thread): the agents serve with sendfile, and a held request
(``?wait=``) costs a thread, not the event loop.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import socket
import threading
import time
from enum import Enum

from dscache_contract.peers import (
    MAX_WAIT_S,
    PEERS_PATH,
    REVISION_HEADER,
    ObjectRequest,
    PeersAnswer,
    PeersRequest,
    RevisionState,
    owner_ranking,
)

from . import agentcall
from .fetch import FILE_MODE

log = logging.getLogger("dscache-stage")

#: A peer that sends no byte for this long is taken for stalled.
READ_TIMEOUT_S = 30.0
#: The longest this node waits for a peer still copying one object, before its next choice.
PATIENCE_S = 180.0
#: How often the node agent is asked again who the peers are. A node that started before this one
#: learns of it within this long; until then it may read objects now ranked to this one, which is
#: why this node first looks at such earlier peers' claims for ``PROBE_S`` (longer than this).
REFRESH_S = 1.0
PROBE_S = 2.5
#: The token file is read again this often (the kubelet updates a rotated Secret in place).
TOKEN_TTL_S = 30.0
CHUNK = 1 << 20

_MD5 = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART = re.compile(r"^([0-9a-f]{32})-([0-9]+)$")
MiB = 1 << 20
#: Part sizes of the common uploaders (boto3 and the AWS CLI: 8 MiB; others 5-64 MiB and more).
PART_SIZES = tuple(n * MiB for n in (8, 5, 16, 10, 15, 32, 64, 50, 100, 128, 256, 512))


class Outcome(Enum):
    PLACED = "placed"  # verified, in the temp file
    NEXT = "next"  # not there (any more): ask the next in the ranking
    BUCKET = "bucket"  # the bytes were wrong: fetch it from the bucket now


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
        sizes = part_sizes(etag, size) or ()
        self.whole = hashlib.md5(usedforsecurity=False) if not sizes else None
        # Per candidate part size: (part size, digests of the parts done, current part's hash, its length)
        self.parts = [(p, list[bytes](), hashlib.md5(usedforsecurity=False), 0) for p in sizes]

    def update(self, chunk: bytes | memoryview) -> None:
        if self.whole is not None:
            self.whole.update(chunk)
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
        if self.whole is not None:
            return self.whole.hexdigest() == self.want
        for _, done, cur, fill in self.parts:
            digests = done + ([cur.digest()] if fill else [])
            got = hashlib.md5(b"".join(digests), usedforsecurity=False).hexdigest() + f"-{len(digests)}"
            if got == self.want:
                return True
        return False


class Peers:
    """This node's view of the other nodes of its revision, and the client that asks them."""

    def __init__(self, agent: str, cache: str, revision: str, token_file: str) -> None:
        self.agent = agent
        self.namespace, self.cache = cache.split("/", 1)
        self.revision = revision
        self.token_file = token_file
        self.answer: PeersAnswer | None = None
        # Peers no longer asked in this run, and why (each is logged once).
        self.failed: dict[str, str] = {}
        self._token: tuple[float, str] = (0.0, "")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[http.client.HTTPConnection] = []

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
        try:
            answer = PeersAnswer.from_json(agentcall.post(self.agent, PEERS_PATH, body, 10))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.debug(f"peers: the agent did not answer: {e}")
            return None
        if not answer.me:
            return None  # the agent does not know its own address: no peer could reach us either
        self.answer = answer
        return answer

    def others(self) -> list[str]:
        a = self.answer
        if a is None:
            return []
        return [p.addr for p in (*a.staging, *a.complete) if p.addr != a.me]

    def ahead_of_me(self, key: str) -> list[str]:
        """The live peers to ask for ``key`` before this node reads the bucket itself ([]: read it now)."""
        a = self.answer
        if a is None or not self.token():
            return []
        out = []
        for addr in owner_ranking(key, a):
            if addr == a.me:
                break
            if addr not in self.failed:
                out.append(addr)
        return out

    def early_peers(self) -> list[str]:
        """Peers that started copying before this node and may not have seen it yet: they read
        the bucket for objects now ranked to this node until they ask their agent again. For
        ``PROBE_S`` after its start this node asks them first, and waits only if they have started
        to read it (their claims), before it reads such an object from the bucket itself."""
        a = self.answer
        if a is None or not self.token():
            return []
        mine = next((p.since for p in a.staging if p.addr == a.me), 0.0)
        if not mine or time.time() > mine + PROBE_S:
            return []
        return [p.addr for p in a.staging if p.since < mine and p.addr != a.me and p.addr not in self.failed]

    def _fail(self, addr: str, why: str) -> None:
        with self._lock:
            if addr not in self.failed:
                self.failed[addr] = why
                log.warning(f"peer {addr}: {why}; not asked again (its objects come from the next node or the bucket)")

    # --- taking an object ----------------------------------------------------------------

    def take(self, addr: str, rel: str, size: int, etag: str, tmp: str, probe: bool = False) -> Outcome:
        """Fetch ``rel`` from ``addr`` into ``tmp`` (created, FILE_MODE), verified; waits while the peer
        is still copying it, up to PATIENCE_S (``probe``: only if it has it now). Blocking: run it on
        a worker thread."""
        deadline = time.monotonic() + PATIENCE_S
        while True:
            try:
                status, state = self._get(
                    addr,
                    ObjectRequest(self.namespace, self.cache, self.revision, rel, MAX_WAIT_S, probe),
                    size,
                    etag,
                    tmp,
                )
            except _Lied as e:
                self._fail(addr, f"sent bytes that do not match the revision's manifest ({e})")
                return Outcome.BUCKET
            except _Local as e:
                raise e.__cause__ or e from None
            except (OSError, http.client.HTTPException, ValueError) as e:
                self._fail(addr, f"failed mid-request ({type(e).__name__}: {e})")
                return Outcome.NEXT
            if status == 200:
                return Outcome.PLACED
            if status == 404 and state == RevisionState.UNCLAIMED:
                return Outcome.NEXT  # a probe: nobody there reads it: this node's own turn
            if status == 404 and state == RevisionState.STAGING and time.monotonic() < deadline:
                continue  # the peer is still copying it: ask again (the request was held MAX_WAIT_S)
            if status == 401:
                self._fail(addr, "refused this cache's peer token")
            elif status == 404 and state == RevisionState.STAGING:
                self._fail(addr, f"has not copied {rel} in {PATIENCE_S:.0f} s (stalled)")
            elif status == 404:
                self._fail(addr, f"neither holds nor copies revision {self.revision} (any more)")
            else:
                self._fail(addr, f"answered HTTP {status}")
            return Outcome.NEXT

    def _conn(self, addr: str) -> http.client.HTTPConnection:
        conns: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(addr)
        if conn is None:
            host, _, port = addr.rpartition(":")
            # A held request answers within MAX_WAIT_S; past that, and between two reads of a body,
            # silence means a stalled peer.
            conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=READ_TIMEOUT_S + MAX_WAIT_S)
            conns[addr] = conn
            with self._lock:
                self._all.append(conn)
        return conn

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
        conn = self._conn(addr)
        path = req.target()
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {self.token()}"})
            resp = conn.getresponse()
            if resp.status != 200:
                text = resp.read().decode(errors="replace")  # whole: the connection is reused
                state = ""
                if resp.status == 404 and '"state"' in text:
                    state = str(json.loads(text).get("state", ""))
                return resp.status, state
            if resp.getheader(REVISION_HEADER) != self.revision:
                raise _Lied(f"it answered for revision {resp.getheader(REVISION_HEADER)!r}")
            length = int(resp.getheader("Content-Length") or -1)
            if length != size:
                resp.close()
                raise _Lied(f"{length} bytes where the manifest says {size}")
            self._receive(resp, size, etag, tmp)
            return 200, ""
        except BaseException:
            conn.close()
            self._local.conns.pop(addr, None)
            raise

    def _receive(self, resp: http.client.HTTPResponse, size: int, etag: str, tmp: str) -> None:
        digest = Digest(etag, size)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        except OSError as e:
            raise _Local() from e
        try:
            got = 0
            with os.fdopen(fd, "wb", closefd=False) as out:
                while got < size:
                    chunk = resp.read(min(CHUNK, size - got))
                    if not chunk:
                        raise http.client.IncompleteRead(b"", size - got)
                    digest.update(chunk)
                    try:
                        out.write(chunk)
                    except OSError as e:
                        raise _Local() from e
                    got += len(chunk)
            if not digest.matches():
                raise _Lied(f"their hash is not the listed ETag {etag}")
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)


class _Lied(Exception):
    """The peer's answer contradicts the manifest."""


class _Local(OSError):
    """Writing our own temp file failed (ENOSPC...): the run's error, not the peer's."""


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

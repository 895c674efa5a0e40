"""The listing from a peer (issue 30; dscache_contract.listings): list the bucket once per cluster.

- ``ListingWriter``: a node that lists the bucket writes every object it hashes into
  ``tmp/listing.part`` as it goes (flushed a page at a time: the agent tells waiting peers how
  far it got), and renames it to ``meta/listing.jsonl`` once the whole listing hashed to the
  revision; its agent serves that file.
- ``from_peers``: before listing, a stager with peers asks the nodes that hold the revision or
  started before it for the revision's listing (``listing_sources``: in the usual case the
  earliest node lists and every other one asks it). A held request (``?wait=``) while that node
  lists; given up when its listing stopped growing for ``STALL_S`` (or it has none), and the
  next one asked, ``MAX_SOURCES`` at most; then the bucket is listed instead.
- The body is streamed to ``tmp/listing.peer`` and every line fed to a ``RevisionHasher``: only a
  listing that hashes to the pinned revision is used (and kept, so this node serves it on); one
  that does not is dropped, the bucket listed, and the log says so. Nothing is held in memory but
  a line and, when read back (``read``), one page: a million keys cost the disk ~100 MB, not RAM.

What the check does not cover: a versioned listing's directory-marker flag (an empty object ``a``
against a marker ``a/``: one key to the revision). A peer that flips it makes this node create an
empty file where a marker was, or skip one empty file; no byte of any other object changes.

The copy starts once the whole listing is here (the peer's listing must hash first). At a million
keys that is the lister's ListObjectsV2 time before the first GET on the other nodes, where their
own listing would have overlapped the copy; the bucket is listed once instead of once per node.
So the lister lists ahead of its own copy (``ahead``: up to ``AHEAD_OBJECTS``), writes and hashes
as the pages come, and puts the listing in place as soon as the whole of it hashed: pulled as its
copy took the pages (paced, a page at a time), its peers waited for most of its copy before
their first GET (issue 30: 20 s of a 35 s copy of 20,000 x 16 KiB on 4 nodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import IO

from dscache_contract import RevisionHasher
from dscache_contract.listings import (
    LISTED_FIELD,
    MAX_LISTING_WAIT_S,
    ListingRequest,
    listing_line,
    listing_part_path,
    listing_path,
    listing_sources,
    parse_listing_line,
)
from dscache_contract.peers import REVISION_HEADER, RevisionState

from . import agenttls
from .layout import Revision
from .listpage import LIST_CHUNK
from .objects import RemoteObject
from .peers import Peers

log = logging.getLogger("dscache-stage")

#: A peer whose listing has not grown for this long (nor appeared) is given up: the bucket is listed.
STALL_S = 10.0
#: No answer this long after a held request's wait, or no byte of a body for this long: stalled.
READ_TIMEOUT_S = 5.0
#: Peers asked for the listing, at most, before this node lists the bucket.
MAX_SOURCES = 3
#: A busy peer (429) is asked again after this pause.
BUSY_PAUSE_S = 0.25
PEER_NAME = "listing.peer"
#: A node that saw no other node in its agent's first answer looks again this much later before it
#: lists: nodes that start together may each see only themselves at first (a label takes a moment
#: to show), and would all list.
SETTLE_S = 0.4
#: Listed objects a lister holds ahead of its own copy, at most (a few tens of MB): its peers wait
#: for the whole listing, and past this it is listed as fast as the copy takes it.
AHEAD_OBJECTS = 1 << 17


class ListingWriter:
    """The listing this node takes from the bucket, for its agent to serve once it is whole."""

    def __init__(self, rev: Revision) -> None:
        self.rev = rev
        self.part = listing_part_path(rev.c, rev.rev)
        self.f: IO[str] = open(self.part, "w", buffering=1 << 16)  # noqa: SIM115 (closed by finish/abort)

    def add(self, key: str, size: int, etag: str, version_id: str | None, marker: bool) -> None:
        self.f.write(listing_line(key, size, etag, version_id, marker))

    def flush(self) -> None:
        """After each page: waiting peers see the listing grow (the agent's ``listed``)."""
        self.f.flush()

    def finish(self) -> None:
        """The listing hashed to the revision: in place for the agent (temp + rename)."""
        self.f.close()
        os.chmod(self.part, 0o444)
        os.replace(self.part, listing_path(self.rev.c, self.rev.rev))

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()
        try:
            os.unlink(self.part)
        except FileNotFoundError:
            pass


def check_file(path: str, rev: str) -> bool:
    """Whether the listing file at ``path`` hashes to ``rev`` (a malformed line: no)."""
    h = RevisionHasher()
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, size, etag, version_id, _ = parse_listing_line(line)
                h.add(key, size, etag, version_id)
    except (OSError, ValueError):
        return False
    return h.revision_id() == rev


def from_peers(peers: Peers, rev: Revision, note: Callable[[str], None]) -> IO[str] | None:
    """The revision's listing, checked (open, at its start), from this node (an earlier run's) or
    a peer; None: this node lists the bucket (it is the listing's first node, or no peer gave one
    that hashes to ``rev``)."""
    local = listing_path(rev.c, rev.rev)
    if os.path.exists(local):
        if check_file(local, rev.rev):
            note(f"listing: revision {rev.rev}'s listing is on this node already (checked); the bucket is not listed")
            return open(local, encoding="utf-8")
        _unlink(local)
    answer = peers.answer
    if answer is None or not peers.token():
        return None
    ahead = [a for a in listing_sources(answer) if a not in peers.failed][:MAX_SOURCES]
    if not ahead:
        return None
    for addr in ahead:
        outcome = _take(peers, addr, rev)
        if outcome == "ok":
            os.replace(os.path.join(rev.tmp, PEER_NAME), local)
            note(f"listing: took revision {rev.rev}'s listing from {addr} (it hashes to the revision)")
            return open(local, encoding="utf-8")
        if outcome.startswith("mismatch"):
            note(
                f"listing: the listing {addr} sent does not hash to revision {rev.rev} ({outcome}); "
                "not used: listing the bucket"
            )
            return None
        log.debug(f"listing: {addr}: {outcome}")
    note(f"listing: no peer had revision {rev.rev}'s listing ({', '.join(ahead[:4])}); listing the bucket")
    return None


def _take(peers: Peers, addr: str, rev: Revision) -> str:
    """Ask ``addr`` for the listing until it sends it or stalls: "ok" (checked, in tmp/), or why not."""
    host, _, port = addr.rpartition(":")
    last_listed, progress_at = 0, time.monotonic()
    while True:
        wait = min(MAX_LISTING_WAIT_S, STALL_S)
        target = ListingRequest(peers.namespace, peers.cache, rev.rev, wait).target()
        conn = agenttls.connection(host.strip("[]"), int(port), wait + READ_TIMEOUT_S)
        try:
            conn.request("GET", target, headers={"Authorization": f"Bearer {peers.token()}"})
            resp = conn.getresponse()
            if resp.status == 200:
                if resp.getheader(REVISION_HEADER) != rev.rev:
                    return f"mismatch: it answered for revision {resp.getheader(REVISION_HEADER)!r}"
                return _receive(resp, rev)
            text = resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as e:
            return f"unreachable: {e}"
        finally:
            conn.close()
        if resp.status == 429:
            time.sleep(BUSY_PAUSE_S)
            continue
        if resp.status != 404:
            return f"HTTP {resp.status}: {text[:200]}"
        try:
            answer = json.loads(text)
            listed, state = int(answer.get(LISTED_FIELD, 0)), str(answer.get("state", ""))
        except (ValueError, TypeError, AttributeError):
            return f"a 404 without its state: {text[:200]}"
        if state == RevisionState.COMPLETE:
            return "it holds the revision without its listing"
        if listed > last_listed:
            last_listed, progress_at = listed, time.monotonic()
        elif time.monotonic() - progress_at >= STALL_S:
            return f"its listing did not grow for {STALL_S:.0f} s ({listed} bytes)"


def _receive(resp: http.client.HTTPResponse, rev: Revision) -> str:
    """Stream the body into tmp/, hashing every line; "ok" if it hashes to ``rev``."""
    path = os.path.join(rev.tmp, PEER_NAME)
    h = RevisionHasher()
    try:
        with open(path, "wb") as out:
            while line := resp.readline(1 << 20):
                if not line.endswith(b"\n"):
                    raise OSError("a line cut short (or longer than 1 MiB)")
                key, size, etag, version_id, _ = parse_listing_line(line.decode("utf-8"))
                h.add(key, size, etag, version_id)
                out.write(line)
    except (ValueError, UnicodeDecodeError) as e:
        _unlink(path)
        return f"mismatch: {e}"
    except (OSError, http.client.HTTPException) as e:
        _unlink(path)
        return f"cut short: {e}"
    if h.revision_id() != rev.rev:
        _unlink(path)
        return f"mismatch: it hashes to {h.revision_id()} ({h.objects} objects)"
    return "ok"


async def read(f: IO[str]) -> AsyncIterator[list[RemoteObject]]:
    """A checked listing file as the bucket's listing would come (listing.list_objects): pages of
    LIST_CHUNK objects, in order. The caller hashes it again as it goes (sync._check_revision), so
    a file changed after its check fails the run rather than stage something else."""
    try:
        page: list[RemoteObject] = []
        for line in f:
            key, size, etag, version_id, marker = parse_listing_line(line)
            page.append(RemoteObject(key, size, etag, version_id, marker))
            if len(page) >= LIST_CHUNK:
                yield page
                page = []
        if page:
            yield page
    finally:
        f.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def ahead(
    pages: AsyncIterator[list[RemoteObject]],
    writer: ListingWriter,
    revision: str,
    relative: Callable[[str], str | None],
    most: int = AHEAD_OBJECTS,
) -> AsyncIterator[list[RemoteObject]]:
    """The bucket's ``pages`` as they come, listed ahead of the caller (``most`` objects at most):
    each page written for the peers as it comes, hashed (the objects ``relative`` keeps, as the
    copy hashes them), and the listing put in place once the whole of it hashed to ``revision``.
    The copy hashes the pages again as it takes them and fails the run on a mismatch, as always."""
    queue: deque[list[RemoteObject]] = deque()
    held = 0
    came = asyncio.Event()  # a page, or the end
    room = asyncio.Event()
    end: list[BaseException | None] = []

    async def pull() -> None:
        nonlocal held
        hasher = RevisionHasher()
        try:
            async for page in pages:
                for obj in page:
                    if relative(obj.key) is not None:
                        hasher.add(obj.key, obj.size, obj.etag, obj.version_id)
                        writer.add(obj.key, obj.size, obj.etag, obj.version_id, obj.marker)
                writer.flush()
                queue.append(page)
                held += len(page)
                came.set()
                while held >= most:
                    room.clear()
                    await room.wait()
            if hasher.revision_id() == revision:
                writer.finish()  # the agent serves it from now on
            end.append(None)
        except Exception as e:  # the copy's: raised where it takes the next page
            end.append(e)
        finally:
            came.set()

    task = asyncio.create_task(pull())
    try:
        while True:
            if queue:
                page = queue.popleft()
                held -= len(page)
                room.set()
                yield page
            elif end:
                if end[0] is not None:
                    raise end[0]
                return
            else:
                came.clear()
                await came.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

"""Fetch once per cluster, the agent's side: who holds a revision, and its objects for peers.

- ``Directory.answer``: the nodes staging or holding a revision, from Node labels: per
  label, the Nodes carrying it are listed once, then kept by a watch of that label
  (``LabelView``), so an answer is read from memory (a stager asks its agent five times
  a second while the cohort forms, then every second: two lists per question cost the
  agents and the API server more CPU than anything else they did for it, issue 30);
  until a view's watch runs, or after it failed, the labels are listed per answer. A
  stager's first question starts the views before its node's label is written, and its
  answer waits (``VIEW_WAIT_S`` at most) for their first listings, this node's own label
  added from memory: one label PATCH and two lists at once, not in turn (issue 30);
- ``open_object``: a complete object of a revision on this node, for a peer that shows
  the cache's token (dscache_contract.peers). Only files under ``revs/<rev>/data/`` are
  served, opened one path component at a time without following any symlink, and a
  file is there only once it is whole (the stager renames it into place), so a copy in
  progress serves exactly the objects it has completed. Nothing is ever written here;
- ``open_growing``: an object a stager here is still writing, for a peer that gave its size
  (GROW_MIN): its bytes are passed on as they come, and the peer checks the whole body.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dscache_contract as contract
from dscache_contract.peers import (
    CLAIMS_NAME,
    RELAY_MARK,
    Peer,
    PeersAnswer,
    RevisionState,
    claims_path,
    grow_name,
    staging_label,
)
from dscache_stager.keys import unsafe_reason

from .disk import valid_name
from .kube import ApiError, Kube

log = logging.getLogger("dscache-node")

#: How long an answer about one revision is reused while its labels are listed, not watched.
ANSWER_TTL_S = 0.2
#: A node gone from a revision's staging view (watched) is still answered as staging this long, unless
#: the warm view has it by then. A copy that completes moves its Node from the staging label to the
#: warm one in one patch, but the two labels are watched apart: an answer between their events
#: lacks that node altogether, and a stager ranking with it takes itself for the root of objects
#: that node read, and reads them again from the bucket. (Issue 30 saw such reads, 1-4 s after
#: the first node completed, in 3 of 17 runs at N = 8; this is one way to them, not shown to be
#: theirs.) A node whose copy ended without completing stays as long: a stager that asks it
#: meanwhile hears that it holds nothing, and asks the next node, as a moment earlier.
LEFT_GRACE_S = 5.0
#: A label's view is dropped (its watch ended) once no stager asked about it for this long.
VIEW_IDLE_S = 60.0
#: Each watch lasts this long, then the label is listed and watched anew (a watch that went
#: silent, its connection lost without a reset, cannot keep a view stale for longer).
WATCH_S = 30
#: After a failed list or watch, the next attempt waits this long (answers list meanwhile).
RETRY_S = 1.0
#: A stager's first question waits this long at most for its views' first listings (started with
#: the question, they list while the Node is labelled), then lists for itself. Its stager gives up
#: after 10 s: at N = 32 on a loaded API server, a PATCH, two lists and a GET in turn took longer
#: (1-5 s each), and that node read every object from the bucket (issue 30).
VIEW_WAIT_S = 4.0
#: And its answer waits, until this long after the question's views were started, for the watch
#: to bring this node's own new label: events come in order, so every label written before it has
#: come too, and the answer is as fresh as a list after the PATCH. (Without it, a first answer made
#: of a list taken while the label was written missed nodes labelled just before, and their first
#: objects were read twice at N = 16.) Past it, the answer goes with what the views have.
OWN_LABEL_BY_S = 6.0
#: How often a held request looks again for the object it waits for.
POLL_S = 0.05


@dataclass(frozen=True)
class Opened:
    fd: int
    size: int
    #: A body a stager here is still writing (its grow file): ``size`` is what the peer says it
    #: will be, and the file is followed as it grows (server.AgentServer._follow).
    growing: bool = False


class NotHere(Exception):
    """The object is not (yet) on this node; ``state`` says whether it may come."""

    def __init__(self, state: RevisionState, message: str) -> None:
        super().__init__(message)
        self.state = state


def revision_state(c: str, rev: str, locked: bool) -> RevisionState:
    if _exists_beneath(c, [contract.REVS_DIR, rev, contract.META_DIR, contract.COMPLETE_NAME]):
        return RevisionState.COMPLETE
    if locked and _exists_beneath(c, [contract.REVS_DIR, rev, contract.DATA_DIR]):
        return RevisionState.STAGING
    return RevisionState.ABSENT


def check_request(namespace: str, cache: str, path: str | None = None) -> None:
    """ValueError when a requested name could step outside the revision's data dir (``path``
    None: the namespace and cache only, as a batch's, whose paths are checked one by one)."""
    if not (valid_name(namespace) and valid_name(cache)):
        raise ValueError(f"{namespace!r}/{cache!r} is not a namespace/name")
    if path is not None and (reason := unsafe_reason(path)):
        raise ValueError(f"path {path!r}: {reason}")


def _open_beneath(c: str, parts: list[str], flags: int = os.O_RDONLY) -> int:
    """Open ``C/<parts...>`` one component at a time, never following a symlink: everything under C
    is writable by the stager's pod, so ``revs``, the revision and ``data`` may be symlinks planted
    to point elsewhere. FileNotFoundError for anything that is not reached through real directories
    (ELOOP, ENOTDIR, EACCES...). O_NONBLOCK: a FIFO planted there cannot hold the open.
    ``revs/<rev>/...``: walked from the revision's directory as REVISION_DIRS keeps it open."""
    if len(parts) >= 3 and parts[0] == contract.REVS_DIR:
        return REVISION_DIRS.open(c, parts[1], parts[2:], flags)
    return _open_from_root(c, parts, flags)


def _open_from_root(c: str, parts: list[str], flags: int) -> int:
    try:
        fd = os.open(c, _WALK)
    except OSError as e:
        raise FileNotFoundError(c) from e
    try:
        return _open_at(fd, parts, flags)
    finally:
        os.close(fd)


#: How a directory on the way is opened: never through a symlink (ELOOP), only a directory.
_WALK = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY


def _open_at(top: int, parts: list[str], flags: int) -> int:
    """``parts`` beneath the open directory ``top`` (left open), one component at a time, as
    _open_beneath."""
    fd = top
    try:
        for part in parts[:-1]:
            nxt = os.open(part, _WALK, dir_fd=fd)
            if fd != top:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    except OSError as e:
        raise FileNotFoundError("/".join(parts)) from e
    finally:
        if fd != top:
            os.close(fd)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


@dataclass
class _RevisionDir:
    fd: int
    identity: tuple[int, int]
    data_fd: int = -1
    data_identity: tuple[int, int] = (0, 0)
    used: float = 0.0

    def close(self) -> None:
        os.close(self.fd)
        if self.data_fd >= 0:
            os.close(self.data_fd)


class RevisionDirs:
    """Revisions' directories (``C/revs/<rev>`` and its ``data/``) kept open once they were reached
    beneath C through real directories only, and used again while their path still names that
    same directory (one lstat: issue 30, a held request's look or a peer's object walked C, revs,
    the revision and data with an openat and a close each, a sixth of the agent's CPU). A
    directory renamed away (a wipe renames the revision aside before removing it), removed or
    replaced, by a symlink too, no longer has the identity kept: it is walked again from C, and a
    symlink refused as before. What lies beneath is walked one component at a time as ever.
    Thread-safe: the opens run under the lock, so a descriptor is never closed while in use."""

    MAX = 64
    #: A directory nobody asked about for this long is closed (a wiped revision's directory is not
    #: held open after it was removed, nor the disk kept busy for an unmount).
    IDLE_S = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: OrderedDict[tuple[str, str], _RevisionDir] = OrderedDict()

    def open(self, c: str, rev: str, parts: list[str], flags: int) -> int:
        """``C/revs/<rev>/<parts...>`` as _open_beneath opens it."""
        path = os.path.join(c, contract.REVS_DIR, rev)
        with self._lock:
            self._close_idle()
            if parts[0] == contract.DATA_DIR and len(parts) > 1:
                data = self._data(c, rev, path)
                return _open_at(data, parts[1:], flags)
            return _open_at(self._revision(c, rev, path).fd, parts, flags)

    def clear(self) -> None:
        with self._lock:
            for d in self._dirs.values():
                d.close()
            self._dirs.clear()

    def _close_idle(self) -> None:
        """Close the directories unused for IDLE_S (the least recently used come first)."""
        now = time.monotonic()
        while self._dirs:
            oldest = next(iter(self._dirs.values()))
            if now - oldest.used < self.IDLE_S:
                return
            self._dirs.popitem(last=False)[1].close()

    def _revision(self, c: str, rev: str, path: str) -> _RevisionDir:
        key = (c, rev)
        known = self._dirs.get(key)
        try:
            now = _identity(os.lstat(path))
        except OSError:
            now = None
        if known is not None:
            if known.identity == now:
                self._dirs.move_to_end(key)
                known.used = time.monotonic()
                return known
            del self._dirs[key]
            known.close()
        fd = _open_from_root(c, [contract.REVS_DIR, rev], os.O_RDONLY | os.O_DIRECTORY)
        try:
            d = _RevisionDir(fd, _identity(os.fstat(fd)), used=time.monotonic())
        except OSError as e:
            os.close(fd)
            raise FileNotFoundError(path) from e
        self._dirs[key] = d
        if len(self._dirs) > self.MAX:
            self._dirs.popitem(last=False)[1].close()
        return d

    def _data(self, c: str, rev: str, path: str) -> int:
        known = self._dirs.get((c, rev))
        if known is not None and known.data_fd >= 0:
            try:
                if _identity(os.lstat(os.path.join(path, contract.DATA_DIR))) == known.data_identity:
                    self._dirs.move_to_end((c, rev))
                    known.used = time.monotonic()
                    return known.data_fd
            except OSError:
                pass
        d = self._revision(c, rev, path)
        if d.data_fd >= 0:
            os.close(d.data_fd)
            d.data_fd = -1
        fd = _open_at(d.fd, [contract.DATA_DIR], os.O_RDONLY | os.O_DIRECTORY)
        try:
            d.data_identity = _identity(os.fstat(fd))
        except OSError as e:
            os.close(fd)
            raise FileNotFoundError(path) from e
        d.data_fd = fd
        return fd

    def nearest(self, c: str, rev: str, path: str) -> tuple[int, str] | None:
        """The deepest directory that exists now on the way to ``data/<path>`` (a new descriptor,
        reached as open() reaches it) and the name under it that is still to come; None when
        there is no data/ (or a component on the way is not a real directory)."""
        parts = path.split("/")
        with self._lock:
            try:
                fd = os.dup(self._data(c, rev, os.path.join(c, contract.REVS_DIR, rev)))
            except (FileNotFoundError, OSError):
                return None
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _WALK, dir_fd=fd)
            except FileNotFoundError:
                return fd, part
            except OSError:
                os.close(fd)
                return None
            os.close(fd)
            fd = nxt
        return fd, parts[-1]


#: The agent's one set (the server's loop and its threads share it).
REVISION_DIRS = RevisionDirs()


def _exists_beneath(c: str, parts: list[str]) -> bool:
    try:
        os.close(_open_beneath(c, parts))
        return True
    except FileNotFoundError:
        return False


def open_object(c: str, rev: str, path: str) -> Opened:
    """Open ``data/<path>`` of revision ``rev`` under C read-only; FileNotFoundError if it is not
    a regular file reached through real directories only."""
    fd = _open_beneath(c, [contract.REVS_DIR, rev, contract.DATA_DIR, *path.split("/")])
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise FileNotFoundError(path)
    return Opened(fd, st.st_size)


def open_tmp_dir(c: str, rev: str) -> int:
    """The revision's tmp/ directory (where grow files are), as every object is opened."""
    return _open_beneath(c, [contract.REVS_DIR, rev, contract.TMP_DIR], os.O_RDONLY | os.O_DIRECTORY)


def open_growing(c: str, rev: str, path: str, size: int) -> Opened | None:
    """The file ``path``'s body grows in while a stager here takes it (dscache_contract.peers.GROW_MIN),
    as ``size`` bytes to come; None when there is none. Like an object, opened one component at a
    time without following a symlink, and only a regular file."""
    try:
        fd = _open_beneath(c, [contract.REVS_DIR, rev, contract.TMP_DIR, grow_name(path)])
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return Opened(fd, size, growing=True)


class Claims:
    """The paths this node's stagers have started to read from the bucket (``tmp/claims``, one per
    line, appended before each GET), and those they have started to take from a peer (the same
    with ``RELAY_MARK`` before it), read incrementally: only what was appended since the last look.
    Held for copies in progress only: a claims file that is gone (sealed, removed) is forgotten."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # claims file -> (inode, bytes read, an unfinished last line, hashes of the claimed lines)
        self._seen: dict[str, tuple[int, int, bytes, set[int]]] = {}

    def claimed(self, c: str, rev: str, path: str, relay: bool = False) -> bool:
        """Whether a stager here reads ``path`` from the bucket (``relay``: or takes it from a peer)."""
        name = claims_path(c, rev)
        with self._lock:
            try:
                fd = _open_beneath(c, [contract.REVS_DIR, rev, contract.TMP_DIR, CLAIMS_NAME])
            except FileNotFoundError:
                self._seen.pop(name, None)
                return False
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return False
                inode = st.st_ino
                seen = self._seen.get(name)
                ino, offset, rest, paths = seen if seen and seen[0] == inode else (inode, 0, b"", set())
                while chunk := os.pread(fd, 1 << 20, offset):
                    offset += len(chunk)
                    *lines, rest = (rest + chunk).split(b"\n")
                    paths.update(hash(line) for line in lines)
                self._seen[name] = (ino, offset, rest, paths)
            finally:
                os.close(fd)
            return hash(path.encode()) in paths or (relay and hash((RELAY_MARK + path).encode()) in paths)


def poll_object(
    c: str,
    rev: str,
    path: str,
    locked: Callable[[str], bool],
    claims: Claims,
    probe: bool = False,
    relay: bool = False,
    first: bool = True,
    state: RevisionState | None = None,
) -> Opened | NotHere:
    """One look: the object if it is whole here; raises NotHere when it will not come (absent,
    or a probe for an object nobody here reads); returns NotHere(STAGING) while it may still come.
    ``first``: try to open it first (False: the caller just did, and it was not there).
    ``state``: the revision's state, looked at once by a caller asking about many of its
    objects (a batch), so the lock and the marker are not looked at again for each."""
    if first:
        try:
            return open_object(c, rev, path)
        except FileNotFoundError:
            pass
    if state is None:
        state = revision_state(c, rev, locked(c))
    if state is RevisionState.COMPLETE:
        # Re-check: the last object may have been placed between the open and the marker.
        try:
            return open_object(c, rev, path)
        except FileNotFoundError:
            raise NotHere(RevisionState.ABSENT, f"{path} is not in revision {rev} on this node") from None
    if state is RevisionState.ABSENT:
        raise NotHere(RevisionState.ABSENT, f"revision {rev} is not on this node and no stager is copying it here")
    if probe and not claims.claimed(c, rev, path, relay):
        raise NotHere(RevisionState.UNCLAIMED, f"no stager here has started to read {path}")
    return NotHere(RevisionState.STAGING, f"{path} is not copied here yet (revision {rev} is in progress)")


def wait_for_object(
    c: str,
    rev: str,
    path: str,
    wait: float,
    locked: Callable[[str], bool],
    claims: Claims,
    probe: bool = False,
    relay: bool = False,
) -> Opened:
    """The object once it is whole, waiting up to ``wait`` seconds while a stager here is still
    copying the revision (``probe``: only while the object is claimed here); NotHere otherwise."""
    deadline = time.monotonic() + wait
    while True:
        got = poll_object(c, rev, path, locked, claims, probe, relay)
        if isinstance(got, Opened):
            return got
        if time.monotonic() >= deadline:
            raise got
        time.sleep(POLL_S)


class LabelView:
    """The Nodes that carry one label, as (agent address, label value) by Node name: listed,
    then watched from that listing's version (label selector: a Node that gains the label is
    ADDED, one that loses it or goes is DELETED), on a thread of its own, until no stager asked
    for ``VIEW_IDLE_S``. ``synced``: False until the first listing, and whenever a list or
    watch failed and the next one has not listed yet (the caller lists for itself then)."""

    def __init__(self, kube: Kube, label: str) -> None:
        self.kube = kube
        self.label = label
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified on every listing and event
        self._nodes: dict[str, tuple[str, str]] = {}
        self.synced = False
        #: Set once the first listing is in, or the first list or watch failed (wait_synced).
        self._settled = threading.Event()
        self.asked = time.monotonic()
        self.done = threading.Event()

    def start(self) -> LabelView:
        threading.Thread(target=self._run, name="label-view", daemon=True).start()
        return self

    def read(self) -> list[tuple[str, str]] | None:
        """The Nodes with the label now; None while the view is not synced."""
        self.asked = time.monotonic()
        with self._lock:
            return list(self._nodes.values()) if self.synced else None

    def wait_synced(self, timeout: float) -> bool:
        """Whether the view is synced, waiting up to ``timeout`` for its first listing (not longer
        than until it failed: then the caller lists for itself at once)."""
        self._settled.wait(timeout)
        return self.synced

    def wait_for(self, name: str, timeout: float) -> bool:
        """Whether Node ``name`` is in the view, waiting up to ``timeout`` for it."""
        with self._changed:
            return self._changed.wait_for(lambda: name in self._nodes, max(0.0, timeout))

    def idle(self) -> bool:
        return time.monotonic() - self.asked > VIEW_IDLE_S

    def _run(self) -> None:
        selector = urllib.parse.quote(self.label, safe="")
        try:
            while not self.idle():
                try:
                    self._list_and_watch(selector)
                except Exception as e:  # the API server restarts, a watch expires: list again
                    with self._lock:
                        self.synced = False
                    self._settled.set()
                    log.info(f"the view of Nodes labelled {self.label} failed ({e}); listing again in {RETRY_S} s")
                    time.sleep(RETRY_S)
        finally:
            self.done.set()

    def _list_and_watch(self, selector: str) -> None:
        listing = self.kube.get(f"/api/v1/nodes?labelSelector={selector}&resourceVersion=0") or {}
        nodes = {}
        for node in listing.get("items") or []:
            if (entry := self._entry(node)) is not None:
                nodes[entry[0]] = entry[1]
        with self._lock:
            self._nodes, self.synced = nodes, True
            self._changed.notify_all()
        self._settled.set()
        version = (listing.get("metadata") or {}).get("resourceVersion", "")
        path = f"/api/v1/nodes?labelSelector={selector}&resourceVersion={version}&allowWatchBookmarks=true"
        for event in self.kube.watch(path, timeout_seconds=WATCH_S):
            if self.idle():
                return
            kind, node = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise ApiError(int(node.get("code") or 0), str(node.get("message") or "watch error"))
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                continue  # BOOKMARK
            name = (node.get("metadata") or {}).get("name", "")
            entry = self._entry(node) if kind != "DELETED" else None
            with self._lock:
                if entry is None:
                    self._nodes.pop(name, None)
                else:
                    self._nodes[name] = entry[1]
                self._changed.notify_all()

    def _entry(self, node: dict[str, Any]) -> tuple[str, tuple[str, str]] | None:
        """(name, (agent address, label value)) of a Node that carries the label and an address."""
        meta = node.get("metadata") or {}
        labels = meta.get("labels") or {}
        addr = _address(node)
        if self.label not in labels or not addr:
            return None
        return str(meta.get("name", "")), (addr, str(labels[self.label]))


class Directory:
    """Which nodes stage or hold a revision, read from their labels (agent addresses: the Node's
    InternalIP and the port its agent labelled it with)."""

    def __init__(self, kube: Kube, node: str, watch: bool = True) -> None:
        self.kube = kube
        self.node = node
        self.watch = watch
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str, str], tuple[float, PeersAnswer]] = {}
        self._views: dict[str, LabelView] = {}
        #: When each revision's first question started its views (prepare), until it is answered.
        self._prepared: dict[tuple[str, str, str], float] = {}
        #: Per revision, each node its staging view had: (its label's value, when it was last there).
        self._staged: dict[tuple[str, str, str], dict[str, tuple[str, float]]] = {}
        self._me = ""

    def prepare(self, namespace: str, cache: str, revision: str) -> None:
        """Start the views of a revision's labels (if they are not running): a stager's first
        question, before its node is labelled, so they list meanwhile."""
        with self._lock:
            self._prepared[(namespace, cache, revision)] = time.monotonic()
        self._read_views(staging_label(namespace, cache, revision), contract.warm_label(namespace, cache, revision))

    def answer(
        self, namespace: str, cache: str, revision: str, fresh: bool = False, since: float | None = None
    ) -> PeersAnswer:
        """``fresh``: this node just labelled itself (its first question about the revision): the
        views' first listings are waited for (``VIEW_WAIT_S`` at most, else the labels are listed),
        then this node's own label's event (``OWN_LABEL_BY_S`` after ``prepare`` at most).
        ``since``: this node's staging label's value (the agent answers only while it stages the
        revision): its own entry is in the answer whatever the views have seen yet (they listed
        while the label was written, and its watch event may come later on a loaded API server)."""
        key = (namespace, cache, revision)
        staging_key, warm_key = staging_label(namespace, cache, revision), contract.warm_label(*key)
        with self._lock:
            prepared = self._prepared.pop(key, None)
        views = self._read_views(staging_key, warm_key, wait=VIEW_WAIT_S if fresh else 0.0)
        if views is not None and fresh:
            own = self._views.get(staging_key)
            by = (prepared if prepared is not None else time.monotonic()) + OWN_LABEL_BY_S
            if own is not None and own.wait_for(self.node, by - time.monotonic()):
                views = self._read_views(staging_key, warm_key)
        if views is None:
            now = time.monotonic()
            with self._lock:
                hit = self._cache.get(key)
                if hit and not fresh and now - hit[0] < ANSWER_TTL_S:
                    return hit[1]
            views = self._nodes(staging_key), self._nodes(warm_key)
        else:
            views = self._with_left(key, views[0], {addr for addr, _ in views[1]}), views[1]
        me = self.me()
        stages = views[0]
        if me and since is not None:
            stages = [e for e in stages if e[0] != me] + [(me, f"{since:.3f}")]
        staging = [Peer(addr, _since(value)) for addr, value in sorted(stages)]
        complete = [Peer(addr) for addr, _ in sorted(views[1])]
        out = PeersAnswer(me=me, staging=staging, complete=complete)
        now = time.monotonic()
        with self._lock:
            self._cache[key] = (now, out)
            # Forget answers nobody asked for lately (a revision's copies end).
            for k, (at, _) in list(self._cache.items()):
                if now - at > 60:
                    del self._cache[k]
                    self._staged.pop(k, None)
        return out

    def _with_left(
        self, key: tuple[str, str, str], stages: list[tuple[str, str]], warm: set[str]
    ) -> list[tuple[str, str]]:
        """``stages`` and the nodes that left them less than LEFT_GRACE_S ago and are not in ``warm``
        (a completed copy between its two label events)."""
        now = time.monotonic()
        with self._lock:
            seen = self._staged.setdefault(key, {})
            for addr, value in stages:
                seen[addr] = (value, now)
            there = {addr for addr, _ in stages}
            left = []
            for addr, (value, at) in list(seen.items()):
                if addr in there:
                    continue
                if addr in warm or now - at >= LEFT_GRACE_S:
                    del seen[addr]
                else:
                    left.append((addr, value))
        return stages + left

    def _read_views(self, *labels: str, wait: float = 0.0) -> tuple[list[tuple[str, str]], ...] | None:
        """Each label's Nodes from its view (started if there is none; up to ``wait`` seconds for its
        first listing); None unless all are synced."""
        if not self.watch:
            return None
        got = []
        with self._lock:
            for k in [k for k, v in self._views.items() if v.done.is_set()]:
                del self._views[k]
            views = [self._views.get(label) for label in labels]
            for i, label in enumerate(labels):
                if views[i] is None:
                    views[i] = self._views[label] = LabelView(self.kube, label).start()
        deadline = time.monotonic() + wait
        for view in views:
            assert view is not None
            if wait > 0:
                view.wait_synced(max(0.0, deadline - time.monotonic()))
            nodes = view.read()
            if nodes is None:
                return None
            got.append(nodes)
        return tuple(got)

    def learn(self, node: dict[str, Any] | None) -> None:
        """This node's own address from its Node as the API server just returned it (the answer to
        the staging label's PATCH): the first question needs no GET of its own for it."""
        if not self._me and node and (addr := _address(node)):
            self._me = addr

    def me(self) -> str:
        # The node's own address as the others compute it; it does not change while the agent runs.
        if not self._me:
            self._me = _address(self.kube.get(f"/api/v1/nodes/{self.node}") or {}) or ""
        return self._me

    def _nodes(self, label: str) -> list[tuple[str, str]]:
        """(agent address, label value) of the Nodes carrying ``label``."""
        selector = urllib.parse.quote(label, safe="")
        try:
            # resourceVersion=0: from the API server's watch cache, not a quorum read of etcd.
            listing = self.kube.get(f"/api/v1/nodes?labelSelector={selector}&resourceVersion=0") or {}
        except ApiError as e:
            # Without peers every stager reads the bucket: slower, never wrong. Say why.
            log.warning(f"cannot list the Nodes that stage or hold a revision (no peers): {e}")
            return []
        out = []
        for node in listing.get("items") or []:
            addr = _address(node)
            if addr:
                out.append((addr, ((node.get("metadata") or {}).get("labels") or {}).get(label, "")))
        return out


def _address(node: dict[str, Any]) -> str | None:
    port = ((node.get("metadata") or {}).get("labels") or {}).get(contract.AGENT_LABEL)
    for a in (node.get("status") or {}).get("addresses") or []:
        if a.get("type") == "InternalIP" and port:
            ip = str(a["address"])
            return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    return None


def _since(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0

"""``dscache-stage wipe``: release leases, then remove what no pod holds; never outside ROOT.

    wipe C --root ROOT --revision R [--release U1,U2]   delete those lease files of R,
        then remove C/revs/R only if no lease file of R remains;
    wipe C --root ROOT --all [--release ...]            remove C only if no lease at all remains;
    wipe C --root ROOT --legacy                         remove the version 1 copy: the top-level
        entries of C that the current layout does not name (contract.TOP_NAMES).

An unknown lease is a pod the operator has not seen finish (or not seen at
all yet), so it keeps the revision; so does anything under C/leases that is no
lease at all (reported as ``stray``: we do not delete what we cannot name).
``--release`` never deletes a lease that names a mount (contract.csi): a published CSI
volume holds it, and only the volume's NodeUnpublishVolume releases it.
Everything happens under C's lock, taken without waiting: while a stager holds
it the wipe does nothing (exit 8) and the operator retries; a stager that
waited behind a wipe writes its lease only after the wipe is done, and stages
again whatever was removed. A revision wipe never removes C itself, so no
pod's mount source disappears.

A version 1 copy has no leases: whether a pod still reads it is the operator's
call (it asks only once no pod without a revision annotation holds on the
node; see dscache_operator.control.nodeplan). Here, two on-disk checks close the gap
its views may lag behind (a pod admitted by a version 1 webhook replica during
the upgrade): a version 1 stager at work holds C/.dscache/lock, which the wipe
takes too, without waiting (and one that starts meanwhile waits for the wipe,
then starts over); and one that ran lately left fresh traces in C/.dscache,
so the wipe waits until it has been quiet for LEGACY_QUIET_S.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import dscache_contract as contract
from dscache_contract import WipeArgs, WipeSummary
from dscache_contract.csi import lease_mount

from .errors import BusyError, UsageError
from .layout import cache_lock, discard, remove_tree

#: Version 1's metadata dir at the top of C, and its lock file inside it.
V1_META = ".dscache"
V1_LOCK = "lock"
#: A version 1 stager that ran within this long (its traces in C/.dscache) keeps the
#: legacy copy: its pod may have started reading a moment ago, before the
#: operator saw it. Far longer than the watch lag plus a helper pod's start
#: (which the driver bounds at 120 s).
LEGACY_QUIET_S = 600.0


def wipe(
    args: WipeArgs,
    before_remove: Callable[[str | None], None] | None = None,
    remove: Callable[[str], None] | None = None,
) -> WipeSummary:
    """``before_remove(revision)`` (None: the whole cache dir) runs under the lock right
    before a removal, once nothing holds it: the node agent takes the revision's warm
    label off its Node there, so the label never outlives the copy. If it raises,
    nothing is removed. ``remove``: removes a tree already renamed out of the way
    (layout.discard); the node agent hands it to a thread of its own."""
    c = _inside_root(args.cache_dir, args.root)
    out = WipeSummary(cache=args.cache_dir, revision=args.revision, released=list(args.release), legacy=args.legacy)
    if c is None:
        return out  # already gone (or never staged on this node)
    try:
        with cache_lock(c, blocking=False):
            if args.legacy:
                _wipe_legacy(c, out)
                return out
            _no_symlink(c, contract.REVS_DIR)
            _no_symlink(c, contract.LEASES_DIR)
            for uid in args.release:
                _release(c, uid, args.revision)
            if args.revision is not None:
                rev_dir = contract.revision_dir(c, args.revision)
                out.existed = os.path.lexists(rev_dir)
                out.leases, out.stray = _revision_leases(c, args.revision)
                if not out.leases and not out.stray:
                    if out.existed and before_remove is not None:
                        before_remove(args.revision)
                    discard(rev_dir, remove)
                    remove_tree(contract.lease_dir(c, args.revision))
                    out.removed = out.existed
            else:
                out.existed = True
                out.leases, out.stray = _all_leases(c)
                if not out.leases and not out.stray:
                    # The lock file goes with C: a stager waiting on it notices
                    # (layout.cache_lock) and fails with CacheGone, never writes.
                    if before_remove is not None:
                        before_remove(None)
                    discard(c, remove)
                    out.removed = True
    except BlockingIOError:
        raise BusyError(
            f"{c} is locked by a running stager (staging a revision); nothing was released "
            f"or removed; retry once it is done"
        ) from None
    return out


# --- leases ---------------------------------------------------------------------------------


def _release(c: str, uid: str, revision: str | None) -> None:
    revs = [revision] if revision is not None else _lease_revisions(c)
    for rev in revs:
        if _entries(contract.lease_dir(c, rev)) is None:
            continue  # no real dir: nothing of ours to release there
        path = contract.lease_path(c, rev, uid)
        if lease_mount(path) is not None:
            continue  # a published CSI volume holds it: only its NodeUnpublishVolume releases it
        try:
            os.unlink(path)  # a symlink is unlinked itself, never followed
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            remove_tree(path)


def _lease_revisions(c: str) -> list[str]:
    out = []
    for name in _entries(contract.leases_root(c)) or []:
        try:
            out.append(contract.validate_revision(name))
        except ValueError:
            continue
    return out


def _revision_leases(c: str, rev: str) -> tuple[list[str], list[str]]:
    """(UIDs holding ``rev``, stray entries): see _classify."""
    uids: set[str] = set()
    stray: list[str] = []
    _classify(c, rev, uids, stray)
    return sorted(uids), stray


def _all_leases(c: str) -> tuple[list[str], list[str]]:
    """(UIDs holding any revision, each once, sorted; stray entries under C/leases)."""
    names = _entries(contract.leases_root(c))
    if names is None:
        return [], [contract.LEASES_DIR]
    uids: set[str] = set()
    stray: list[str] = []
    for name in names:
        try:
            contract.validate_revision(name)
        except ValueError:
            stray.append(f"{contract.LEASES_DIR}/{name}")
            continue
        _classify(c, name, uids, stray)
    return sorted(uids), stray


def _classify(c: str, rev: str, uids: set[str], stray: list[str]) -> None:
    """Sort the entries of C/leases/<rev> into pod UIDs and stray paths (relative to C).

    Any entry named like a pod UID is a lease, whatever its type (--release
    removes files and dirs alike). A name that is no UID, or a lease dir that
    is no real directory, cannot be released by the operator: it is stray.
    """
    names = _entries(contract.lease_dir(c, rev))
    if names is None:
        stray.append(f"{contract.LEASES_DIR}/{rev}")
        return
    for name in names:
        try:
            uids.add(contract.validate_pod_uid(name))
        except ValueError:
            stray.append(f"{contract.LEASES_DIR}/{rev}/{name}")


def _entries(directory: str) -> list[str] | None:
    """The sorted names in ``directory``; [] if it does not exist; None if it is no real dir."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return None
    return sorted(os.listdir(directory))


def _no_symlink(c: str, name: str) -> None:
    """Refuse to work through C/<name> if it is a symlink (paths below it would be followed)."""
    if os.path.islink(os.path.join(c, name)):
        raise UsageError(
            f"refusing to wipe {c!r}: {os.path.join(c, name)!r} is a symlink; the stager never makes one, "
            f"so someone else did: remove it by hand"
        )


# --- the version 1 copy ---------------------------------------------------------------------


def _wipe_legacy(c: str, out: WipeSummary) -> None:
    """Remove every top-level entry of C that the current layout does not name.

    Never revs/, leases/ or the lock (contract.TOP_NAMES); each entry is
    removed without following symlinks (remove_tree), and C is a real dir
    inside ROOT (_inside_root). C/.dscache, which holds version 1's lock, goes
    last, so that lock stays held until everything else is gone.
    """
    names = sorted(n for n in os.listdir(c) if n not in contract.TOP_NAMES)
    out.existed = bool(names)
    if not names:
        return
    with _v1_lock(c):
        quiet = _v1_quiet_for(c)
        if quiet is not None and quiet < LEGACY_QUIET_S:
            raise BusyError(
                f"a version 1 stager ran in {c} {max(quiet, 0):.0f} s ago (its {V1_META}/ changed): its pod may "
                f"be reading that copy; nothing was removed; retry once it has been quiet for "
                f"{LEGACY_QUIET_S:.0f} s"
            )
        for name in names:
            if name != V1_META:
                remove_tree(os.path.join(c, name))
        remove_tree(os.path.join(c, V1_META))  # also when _v1_lock made it
    out.removed, out.legacy_entries = True, len(names)


@contextmanager
def _v1_lock(c: str) -> Iterator[None]:
    """Hold version 1's lock (C/.dscache/lock) without waiting; made if missing.

    Made, so that a version 1 stager starting while we delete waits for us
    (its locked() makes C/.dscache and the lock too, and blocks on ours); once
    we unlinked both, it finds its lock file gone and starts over on a fresh
    copy. Never reached through a symlink: C/.dscache is opened O_NOFOLLOW and
    the lock relative to it; if either is no real dir or file, no version 1
    stager can lock there either, and the entry is simply unlinked.
    """
    meta = os.path.join(c, V1_META)
    try:
        os.mkdir(meta, 0o755)
    except FileExistsError:
        pass
    try:
        d = os.open(meta, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        fd = os.open(V1_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644, dir_fd=d)
    except OSError:
        fd = -1
    finally:
        os.close(d)
    if fd < 0:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BusyError(
                f"a version 1 stager is staging into {c} (it holds {V1_META}/{V1_LOCK}); nothing was "
                f"removed; retry once it is done"
            ) from None
        yield
    finally:
        os.close(fd)


#: What every version 1 run changes in C/.dscache: it recreates tmp/ when it
#: starts, writes its manifest and marker through tmp/ when it ends.
_V1_TRACES = ("tmp", "complete", "manifest.jsonl", "journal.jsonl")


def _v1_quiet_for(c: str) -> float | None:
    """Seconds since a version 1 stager last ran in C, by the node's own clock
    (the newest mtime of its traces; not the lock, which we may have made);
    None if it left none."""
    newest = None
    for name in _V1_TRACES:
        try:
            mtime = os.lstat(os.path.join(c, V1_META, name)).st_mtime
        except (FileNotFoundError, NotADirectoryError):
            continue
        newest = mtime if newest is None else max(newest, mtime)
    return None if newest is None else time.time() - newest


def _inside_root(directory: str, root: str) -> str | None:
    """The real path of ``directory`` if it lies strictly inside ``root``; None if it does not exist.

    Both paths are resolved lexically and through the real filesystem: a
    ``directory`` that is, or passes through, a symlink is refused, so a link
    planted inside the cache cannot redirect the delete elsewhere. The root
    itself may be a symlink the admin chose.
    """
    if not os.path.isabs(directory) or not os.path.isabs(root):
        raise UsageError(f"wipe needs absolute paths, got CACHE_DIR={directory!r} ROOT={root!r}")
    root_norm, target = os.path.normpath(root), os.path.normpath(directory)
    if os.path.commonpath([root_norm, target]) != root_norm or target == root_norm:
        raise UsageError(f"refusing to wipe {directory!r}: it is not inside the cache root {root!r}")
    current = os.path.realpath(root_norm)
    for part in os.path.relpath(target, root_norm).split(os.sep):
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(f"refusing to wipe {directory!r}: {current!r} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"refusing to wipe {directory!r}: it is not a directory")
    return current

"""``dscache-stage wipe``: release leases, then remove what no pod holds; never outside ROOT.

    wipe C --root ROOT --revision R [--release U1,U2]   delete those lease files of R,
        then remove C/revs/R only if no lease file of R remains;
    wipe C --root ROOT --all [--release ...]            remove C only if no lease at all remains.

An unknown lease is a pod the operator has not seen finish (or not seen at
all yet), so it keeps the revision. Everything happens under C's lock, taken
without waiting: while a stager holds it the wipe does nothing (exit 8) and
the operator retries; a stager that waited behind a wipe writes its lease
only after the wipe is done, and stages again whatever was removed.
A revision wipe never removes C itself, so no pod's mount source disappears.
"""

from __future__ import annotations

import os
import stat

import dscache_contract as contract
from dscache_contract import WipeArgs, WipeSummary

from .errors import BusyError, UsageError
from .layout import cache_lock, leases, remove_tree


def wipe(args: WipeArgs) -> WipeSummary:
    c = _inside_root(args.cache_dir, args.root)
    out = WipeSummary(cache=args.cache_dir, revision=args.revision, released=list(args.release))
    if c is None:
        return out  # already gone (or never staged on this node)
    try:
        with cache_lock(c, blocking=False):
            for uid in args.release:
                _release(c, uid, args.revision)
            if args.revision is not None:
                rev_dir = contract.revision_dir(c, args.revision)
                out.existed = os.path.lexists(rev_dir)
                out.leases = leases(c, args.revision)
                if not out.leases:
                    remove_tree(rev_dir)
                    remove_tree(contract.lease_dir(c, args.revision))
                    out.removed = out.existed
            else:
                out.existed = True
                out.leases = _all_leases(c)
                if not out.leases:
                    # The lock file goes with C: a stager waiting on it notices
                    # (layout.cache_lock) and fails with CacheGone, never writes.
                    remove_tree(c)
                    out.removed = True
    except BlockingIOError:
        raise BusyError(
            f"{c} is locked by a running stager (staging a revision); nothing was released "
            f"or removed; retry once it is done"
        ) from None
    return out


def _release(c: str, uid: str, revision: str | None) -> None:
    revs = [revision] if revision is not None else _lease_revisions(c)
    for rev in revs:
        try:
            os.unlink(contract.lease_path(c, rev, uid))
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            remove_tree(contract.lease_path(c, rev, uid))


def _lease_revisions(c: str) -> list[str]:
    try:
        names = os.listdir(contract.leases_root(c))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        try:
            out.append(contract.validate_revision(name))
        except ValueError:
            continue
    return out


def _all_leases(c: str) -> list[str]:
    """Every lease under C, as "<rev>/<uid>"; anything unexpected in leases/ counts as held."""
    try:
        names = sorted(os.listdir(contract.leases_root(c)))
    except FileNotFoundError:
        return []
    held = []
    for name in names:
        path = os.path.join(contract.leases_root(c), name)
        if os.path.isdir(path) and not os.path.islink(path):
            held += [f"{name}/{uid}" for uid in sorted(os.listdir(path))]
        else:
            held.append(name)
    return held


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

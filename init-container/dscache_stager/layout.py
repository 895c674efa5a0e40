"""One cache dir C on the node: its lock, its leases, and its revisions.

The paths are the contract's (dscache_contract.paths); this module does the
I/O on them:

    C/lock                        flock target: stagers and wipes
    C/revs/<rev>/data/            the revision's objects; 0444 files, 0555 dirs once complete
    C/revs/<rev>/meta/            manifest.jsonl, then complete (written last); journal while staging
    C/revs/<rev>/tmp/             downloads in flight, renamed into data/ when whole
    C/leases/<rev>/<pod-uid>      one lease per pod using <rev> on this node
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import dscache_contract as contract
from dscache_contract import ManifestEntry, StageSummary

from .errors import CacheGoneError, DestinationError


def cache_gone_message(c: str) -> str:
    return (
        f"the cache dir {c} was removed from the node after this pod started (its DatasetCache was "
        f"deleted, or the node's copy wiped with --all); nothing was staged. Delete this pod so that "
        f"it is recreated with a fresh cache dir, or recreate the DatasetCache first"
    )


def check_cache_dir(c: str) -> None:
    """Make C exist, or say clearly that the pod's mount source is gone.

    In a pod, C is a bind mount of the node's dir. If that dir was deleted,
    the mount point still resolves but to an unlinked directory (st_nlink 0),
    where every create fails with ENOENT. Run by hand, C is just created.
    """
    try:
        st = os.stat(c)
    except FileNotFoundError:
        try:
            os.makedirs(c, 0o755, exist_ok=True)
        except OSError as e:
            raise DestinationError(
                f"cannot create the cache dir {c}: {e.strerror}; check the cache volume and its permissions"
            ) from e
        return
    if not stat.S_ISDIR(st.st_mode):
        raise DestinationError(f"the cache dir {c} is not a directory; check the cache volume")
    if st.st_nlink == 0:
        raise CacheGoneError(cache_gone_message(c))


@contextmanager
def cache_lock(c: str, on_wait: Callable[[], None] | None = None, blocking: bool = True) -> Iterator[int]:
    """Hold the exclusive kernel lock on C for the duration (yields the fd).

    flock() dies with its holder, so a killed stager never leaves a stale
    lock. A wipe with --all deletes C (lock file included) while holding the
    lock; a stager that waited through it finds its lock file unlinked and
    looks again: C recreated by hand, or its mount source gone (CacheGoneError).
    """
    while True:
        check_cache_dir(c)
        path = contract.lock_path(c)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileNotFoundError as e:
            raise CacheGoneError(cache_gone_message(c)) from e
        except OSError as e:
            raise DestinationError(
                f"cannot open {path}: {e.strerror}; check the cache volume and its permissions"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                os.close(fd)
                raise
            if on_wait:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        if _still_linked(fd, path):
            break
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _still_linked(fd: int, path: str) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def write_lease(c: str, rev: str, pod_uid: str) -> str:
    """Record that pod ``pod_uid`` uses ``rev`` on this node. Call with the lock held."""
    d = contract.lease_dir(c, rev)
    path = contract.lease_path(c, rev, pod_uid)
    try:
        os.makedirs(d, 0o755, exist_ok=True)
        write_atomic(path, json.dumps({"pod_uid": pod_uid, "revision": rev, "at": time.time()}) + "\n", d, mode=0o644)
    except FileNotFoundError as e:
        raise CacheGoneError(cache_gone_message(c)) from e
    except OSError as e:
        raise DestinationError(f"cannot write the lease {path}: {e.strerror}; check the cache volume") from e
    return path


class Revision:
    """The files of one revision under C."""

    def __init__(self, c: str, rev: str) -> None:
        self.c = c
        self.rev = rev
        self.dir = contract.revision_dir(c, rev)
        self.data = contract.data_dir(c, rev)
        self.meta = contract.meta_dir(c, rev)
        self.tmp = contract.tmp_dir(c, rev)
        self.manifest_path = contract.manifest_path(c, rev)
        self.complete_path = contract.complete_path(c, rev)
        self.journal_path = contract.journal_path(c, rev)

    # --- reading (safe without the lock: a complete revision never changes) --

    def read_complete(self) -> StageSummary | None:
        """The summary the completion marker holds; None: not complete (or not readable as one)."""
        try:
            with open(self.complete_path) as f:
                return StageSummary.from_message(f.read())
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None

    def sealed_before_boot(self) -> bool:
        """Whether the completion marker predates the node's last boot.

        Nothing is fsynced (see seal), so such a revision may hold
        zeros or stale bytes behind a correct manifest. No pod has used it
        since the boot either: every pod's stager reruns after a reboot, and
        the first one restages it (a fresh marker), so it is safe to remove.
        """
        try:
            return os.stat(self.complete_path).st_mtime < boot_time()
        except (FileNotFoundError, NotADirectoryError):
            return False

    def first_key(self) -> str | None:
        """The first object of a complete revision's manifest (the warm access probe)."""
        try:
            with open(self.manifest_path) as f:
                line = f.readline()
            return ManifestEntry.from_json(line).key if line else None
        except (OSError, ValueError, KeyError):
            return None

    # --- staging (with the lock held) ----------------------------------------

    def prepare(self) -> bool:
        """Create the revision's dirs; drop temp files of a killed run. True if data/ already had files."""
        try:
            revs = contract.revisions_root(self.c)
            os.makedirs(revs, 0o755, exist_ok=True)
            spread_subdirs(revs)
            if not os.path.lexists(self.dir):
                make_dir_unnamed(self.dir)
            for d in (self.data, self.meta):
                os.makedirs(d, 0o755, exist_ok=True)
            if os.path.lexists(self.tmp):  # a killed run's; shutil (and zlib, bz2, lzma) only then
                import shutil

                shutil.rmtree(self.tmp, ignore_errors=True)
            os.mkdir(self.tmp, 0o755)
            with os.scandir(self.data) as it:
                return any(True for _ in it)
        except FileNotFoundError as e:
            if os.stat(self.c).st_nlink == 0:
                raise CacheGoneError(cache_gone_message(self.c)) from e
            raise

    def known_entries(self) -> dict[str, ManifestEntry]:
        """Objects an unfinished earlier run placed (its journal).

        Records written before the node last booted are ignored: their data
        may never have reached the disk (nothing is fsynced), so those files
        are fetched again.
        """
        known: dict[str, ManifestEntry] = {}
        try:
            if os.stat(self.journal_path).st_mtime < boot_time():
                return known
        except FileNotFoundError:
            return known
        for entry in read_entries(self.journal_path):
            known[entry.path] = entry
        return known

    def open_journal(self) -> IO[str]:
        return open(self.journal_path, "a", buffering=1 << 16)

    def seal(self, manifest: str, dirs: Iterable[str], summary: StageSummary) -> None:
        """Seal the revision: manifest, read-only tree, then the marker, written last.

        ``manifest`` is a complete manifest file under tmp/, moved into place
        as is: at a million keys it is never held in memory.
        Files were created 0444; directories become 0555 here, so no uid but
        root can change a complete revision. Nothing is fsynced: training
        should start the moment the bytes are in the page cache. A crash
        before the marker leaves a journal that the next run resumes from.
        """
        os.chmod(manifest, 0o444)
        os.rename(manifest, self.manifest_path)
        # Deepest first, so a parent is sealed after its children.
        for rel in sorted(dirs, key=lambda d: d.count("/"), reverse=True):
            if rel:
                os.chmod(os.path.join(self.data, rel), 0o555)
        os.chmod(self.data, 0o555)
        write_atomic(self.complete_path, summary.to_json() + "\n", self.tmp)
        try:
            os.unlink(self.journal_path)
        except FileNotFoundError:
            pass
        os.rmdir(self.tmp)
        os.chmod(self.meta, 0o555)
        os.chmod(self.dir, 0o555)

    def remove(self) -> None:
        """Delete the revision: incomplete (the bucket can no longer serve it), or sealed before the last boot."""
        remove_tree(self.dir)


#: FS_IOC_GETFLAGS and FS_IOC_SETFLAGS (linux/fs.h: _IOR/_IOW('f', 1/2, long) as x86-64, arm64 and
#: riscv encode them; elsewhere the ioctl fails with ENOTTY and nothing changes), and FS_TOPDIR_FL.
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_TOPDIR_FL = 0x00020000


def spread_subdirs(directory: str) -> bool:
    """Mark ``directory`` a top of hierarchies (``chattr +T``): ext4 then places each directory
    made in it in a block group of its own choosing (Orlov: few directories, free inodes and
    blocks above average), where it would otherwise put it next to its parent.

    Why: a node that wipes a revision and stages another creates the new revision's files in
    the block group the old one's were freed from, when both sit next to revs/. Without a
    journal (a common setup for a node's scratch NVMe), ext4 skips inodes freed in the last
    minute (five while their table block is dirty) and scans the group's free inodes from its
    start, each a buffer-cache lookup, for every file it creates (recently_deleted, under
    find_inode_bit): in bench/stager.py's small set, a fifth of the native threads' CPU
    samples and a sixth of the stager's own; none once revs/ has the flag. Best effort: other
    filesystems (xfs, tmpfs, overlayfs) have no such flag (ENOTTY, EOPNOTSUPP, EINVAL), and a
    revs/ another uid owns refuses it (EPERM); the copy is correct either way. True if set.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        # The kernel reads and writes an int at the address, whatever the name's "long" says.
        buf = bytearray(8)
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
        flags = int.from_bytes(buf[:4], sys.byteorder)
        if flags & FS_TOPDIR_FL:
            return True
        buf[:4] = (flags | FS_TOPDIR_FL).to_bytes(4, sys.byteorder)
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, buf, False)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def make_dir_unnamed(path: str) -> None:
    """Create the directory ``path`` under a name of its own first, then rename it into place.

    Where ext4 places a directory made in a top of hierarchies (spread_subdirs) starts from a
    hash of its name: a revision staged again under the same name would start from the same
    block group as the copy wiped before it. A fresh name each time makes the start random.
    The interim name has the NEW_PREFIX, which no reader takes for a revision. Not the
    GONE_PREFIX: the node agent removes those whenever it sees them, and its removal (fd-based)
    could run on inside the directory once renamed into place. An interim dir a killed process
    left is empty (nothing is made in it before the rename), and only a stager holding the
    cache's lock makes one: the next removes such leftovers here. Any failure of that route:
    plain makedirs.
    """
    parent, name = os.path.split(path.rstrip("/"))
    try:
        with os.scandir(parent) as it:
            for entry in it:
                if entry.name.startswith(NEW_PREFIX):
                    with contextlib.suppress(OSError):
                        os.rmdir(entry.path)  # empty, or not ours to touch
    except OSError:
        pass
    interim = os.path.join(parent, f"{NEW_PREFIX}{name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(interim, 0o755)
    except OSError:
        os.makedirs(path, 0o755, exist_ok=True)
        return
    try:
        os.rename(interim, path)  # onto a directory made meanwhile only if it is empty
    except OSError:
        try:
            os.rmdir(interim)
        except OSError:
            pass
        os.makedirs(path, 0o755, exist_ok=True)


def remove_tree(path: str) -> None:
    """rmtree that never follows symlinks and gets through sealed (0555) directories.

    Sealed dirs refuse unlinks to any uid without CAP_DAC_OVERRIDE, and the
    wipe helper runs as uid 0 with every capability dropped. We own them, so
    on EACCES/EPERM the parent is reopened without following links and made
    writable (fchmod on that fd), then the step is retried.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)  # a symlink or file where a dir was expected: remove the entry only
        return
    import shutil  # here: it imports zlib, bz2 and lzma, which a cold start does without

    def on_error(func: Callable[..., Any], p: str, exc_info: tuple[type[BaseException], BaseException, Any]) -> None:
        exc = exc_info[1]
        if isinstance(exc, FileNotFoundError):
            return
        if not isinstance(exc, PermissionError):
            raise exc
        _make_writable(os.path.dirname(p))
        if func in (os.rmdir, os.unlink) or getattr(func, "__name__", "") in ("rmdir", "unlink"):
            func(p)
        else:  # scandir/open of a dir we may not read: make it readable, then start over on it
            _make_writable(p)
            shutil.rmtree(p, onerror=on_error)

    shutil.rmtree(path, onerror=on_error)


#: Prefix of a directory on its way out (see discard); readers and scanners skip it.
GONE_PREFIX = ".gone-"
#: Prefix of a revision directory on its way in (make_dir_unnamed); readers and scanners skip it.
NEW_PREFIX = ".new-"


def discard(path: str, remove: Callable[[str], None] | None = None) -> None:
    """Remove a revision dir (or a cache dir) so that it is never seen half removed.

    It is first renamed to a sibling ``.gone-<name>-<nonce>`` (atomic, and no
    write permission on a sealed dir is needed within one parent), then removed.
    A process killed in between leaves only a ``.gone-`` entry, which no reader
    takes for a revision and the node agent removes when it next reads the disk;
    without the rename, a kill could leave a revision whose completion marker
    survived its data. Once renamed, nothing reads the tree: its removal may run later.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    parent, name = os.path.split(path.rstrip("/"))
    gone = os.path.join(parent, f"{GONE_PREFIX}{name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, gone)
    # ``remove``: who removes the renamed tree (the node agent does it on a thread of its own, so
    # that its lock is not held while a large tree goes); here and now by default.
    (remove or remove_tree)(gone)


def _make_writable(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)


def boot_time() -> float:
    """When this node booted, in epoch seconds (0 if unknown)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def read_entries(path: str) -> Iterator[ManifestEntry]:
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            try:
                yield ManifestEntry.from_json(line)
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a killed run


def write_atomic(path: str, text: str, tmp_dir: str, mode: int = 0o444) -> None:
    tmp = os.path.join(tmp_dir, f".{os.path.basename(path)}.{os.getpid()}.{time.monotonic_ns()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.rename(tmp, path)

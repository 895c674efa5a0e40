"""What the node's disk holds under cacheRoot: read, never written, except leftovers of removals.

    <root>/<namespace>/<cache>/revs/<rev>/meta/complete     a complete revision (its StageSummary)
    <root>/<namespace>/<cache>/leases/<rev>/<pod-uid>       a pod holding <rev>
    .../.gone-*                                             a removal a killed process left behind

The disk is the truth: the agent keeps no state of its own that a restart
could lose. Everything it publishes is recomputed from a scan.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass

import dscache_contract as contract
from dscache_stager.layout import GONE_PREFIX, remove_tree

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


@dataclass(frozen=True)
class OnDisk:
    namespace: str
    cache: str
    revision: str
    bytes: int
    complete: bool
    leases: tuple[str, ...]
    #: The LRU clock: the last change of its leases, or its sealing if it never had one.
    released_at: float
    #: The completion marker's (mtime_ns, inode): a new copy under the same id is verified anew.
    sealed: tuple[int, int] | None
    #: What a complete copy takes on the disk (``footprint``); its bytes when not known.
    disk_bytes: int = -1

    @property
    def held(self) -> int:
        """The bytes this copy counts for against the budget and the filesystem."""
        return self.disk_bytes if self.disk_bytes >= 0 else self.bytes

    @property
    def cache_dir(self) -> tuple[str, str]:
        return (self.namespace, self.cache)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.namespace, self.cache, self.revision)


def valid_name(name: str) -> bool:
    """A namespace or DatasetCache name (DNS-1123), so it names one directory level under the root."""
    return bool(_NAME.match(name))


def _dirs(path: str) -> list[str]:
    """Names of the real (not symlinked) directories in ``path``; [] if it is none."""
    try:
        with os.scandir(path) as it:
            return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


def caches(root: str) -> Iterator[tuple[str, str]]:
    for ns in _dirs(root):
        if not _NAME.match(ns):
            continue
        for cache in _dirs(os.path.join(root, ns)):
            if _NAME.match(cache):
                yield ns, cache


def block_size(root: str) -> int:
    try:
        return max(512, os.statvfs(root).f_frsize)
    except OSError:
        return 4096


def footprint(nbytes: int, objects: int, block: int) -> int:
    """What ``objects`` files of ``nbytes`` in all take on a filesystem of ``block``-byte blocks, at
    most: each file is rounded up to whole blocks (up to a block less one each), and its share of
    the directories and inodes is about one block more. 1M files of 1 KiB take 4 GiB of 4 KiB
    blocks, not 1 GiB; for large files this adds nothing that matters."""
    return nbytes + objects * block


def scan(root: str) -> list[OnDisk]:
    out = []
    block = block_size(root) if os.path.isdir(root) else 4096
    for ns, cache in caches(root):
        c = contract.cache_dir(root, ns, cache)
        for name in _dirs(contract.revisions_root(c)):
            try:
                rev = contract.validate_revision(name)
            except ValueError:
                continue
            out.append(read_revision(c, ns, cache, rev, block))
    return out


def scan_cache(c: str, ns: str, cache: str) -> list[OnDisk]:
    """The revisions of one cache dir."""
    out = []
    for name in _dirs(contract.revisions_root(c)):
        try:
            rev = contract.validate_revision(name)
        except ValueError:
            continue
        out.append(read_revision(c, ns, cache, rev))
    return out


def read_revision(c: str, ns: str, cache: str, rev: str, block: int = 4096) -> OnDisk:
    marker = contract.complete_path(c, rev)
    nbytes, complete, sealed, sealed_at, on_disk = 0, False, None, 0.0, -1
    try:
        st = os.stat(marker)
        with open(marker) as f:
            summary = contract.StageSummary.from_message(f.read())
        if summary is not None:
            nbytes, complete = summary.bytes, True
            on_disk = footprint(summary.bytes, summary.objects, block)
            sealed, sealed_at = (st.st_mtime_ns, st.st_ino), st.st_mtime
    except (OSError, ValueError):
        pass
    lease_dir = contract.lease_dir(c, rev)
    try:
        leases = tuple(sorted(os.listdir(lease_dir)))
        released_at = max(os.stat(lease_dir).st_mtime, sealed_at)
    except (FileNotFoundError, NotADirectoryError):
        leases, released_at = (), sealed_at
    return OnDisk(ns, cache, rev, nbytes, complete, leases, released_at, sealed, on_disk)


def verify(c: str, rev: str) -> str | None:
    """Check a complete revision against its manifest: every entry a regular file of its size.

    None when it holds; else what is wrong. (ETags are not recomputed: that
    would read every byte. The stager checked each object's size and ETag as it
    wrote it, and a sealed tree is read-only; this catches what happened since:
    a tree emptied or cut short by hand, or a disk that lost files.)
    """
    data = contract.data_dir(c, rev)
    try:
        with open(contract.manifest_path(c, rev)) as f:
            for n, line in enumerate(f, 1):
                entry = contract.ManifestEntry.from_json(line)
                try:
                    st = os.lstat(os.path.join(data, entry.path))
                except FileNotFoundError:
                    return f"{entry.path} (manifest line {n}) is missing"
                if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                    return f"{entry.path} (manifest line {n}) is not a file of {entry.size} bytes"
    except (OSError, ValueError, KeyError) as e:
        return f"the manifest cannot be read: {e}"
    return None


def leftovers(root: str) -> list[str]:
    """``.gone-`` entries: removals a killed process did not finish."""
    out = []
    for ns in _dirs(root):
        nsdir = os.path.join(root, ns)
        out += [os.path.join(nsdir, n) for n in _dirs(nsdir) if n.startswith(GONE_PREFIX)]
        for cache in _dirs(nsdir):
            revs = os.path.join(nsdir, cache, contract.REVS_DIR)
            out += [os.path.join(revs, n) for n in _dirs(revs) if n.startswith(GONE_PREFIX)]
    return out


def finish_removals(root: str) -> int:
    paths = leftovers(root)
    for p in paths:
        remove_tree(p)
    return len(paths)


def usage(path: str) -> int:
    """The bytes the tree at ``path`` takes on the disk (its blocks), never following a symlink;
    0 if it is not there."""
    total = 0
    stack = [path]
    while stack:
        top = stack.pop()
        try:
            with os.scandir(top) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
        except OSError:
            continue
    return total


def filesystem(root: str) -> tuple[int, int]:
    """(size, free) of the cacheRoot filesystem, in bytes (free: what an unprivileged writer gets)."""
    os.makedirs(root, 0o755, exist_ok=True)
    usage = shutil.disk_usage(root)
    return usage.total, usage.free

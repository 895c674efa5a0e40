"""A cold copy's bookkeeping, without asyncio: what is done with each listed object, the space
reserved, the revision check, the empty objects' decisions, the journal, the manifest, the
summary and the error each failure becomes.

Two copies build on it: sync._Run, asyncio's (the listing streamed, peers, many batches in
flight), and onepage.OnePage, for a revision whose whole listing came in the access proof's first
page (issue 30: importing asyncio costs a cold start 40 ms of its ~135 after a page-cache drop).
Keeping everything but the orchestration here means both stage, check and fail alike.
"""

from __future__ import annotations

import errno
import heapq
import os
import time
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING

from dscache_contract import ManifestEntry, RevisionHasher, StageSummary, human_bytes

from .errors import DestinationError, HostileKeysError, NoSpaceError, RevisionGoneError, StageError
from .keys import TreeShape, unsafe_reason
from .objects import Fetched, ObjectGone, RemoteObject
from .source import source_error
from .store import kind
from .tree import LocalTree

if TYPE_CHECKING:
    from .layout import Revision
    from .listpage import Started
    from .native import NativeFetcher
    from .progress import Progress
    from .store import AnyStore
    from .sync_options import SyncOptions

BLOCK = 4096
MAX_KEYS_SHOWN = 20

#: One object to copy: (object, path under data/, its manifest line).
Task = tuple[RemoteObject, str, str]


class CopyRun:
    """One cold copy of ``rev``: the state both orchestrations share, and what they do alike."""

    #: The thread the control plane runs on, as the closing note names it.
    control_thread = "event-loop thread"

    def __init__(
        self, opts: SyncOptions, rev: Revision, store: AnyStore, progress: Progress, started: Started | None = None
    ) -> None:
        self.opts = opts
        self.source = opts.source
        self.selection = opts.selection
        self.rev = rev
        self.store = store
        self.progress = progress
        self.tree = LocalTree(rev.data)
        self.shape = TreeShape()
        self.hasher = RevisionHasher()
        # Nothing here grows with the listing (issue 9: 1M keys in <= 256 MiB):
        # each object's manifest line goes to a file in listing order the
        # moment it is listed, and the counts are counters. Only empty objects
        # (few; each needs a HEAD, see _settle_empty) and directories are held.
        self.objects = 0
        self.bytes = 0
        self.manifest_tmp = os.path.join(rev.tmp, "manifest.listed")
        self.hostile: list[tuple[str, str]] = []
        self.empties: list[tuple[RemoteObject, str, str | None]] = []
        self.placed_empties: dict[str, ManifestEntry] = {}
        self.fetched_bytes = 0
        self.peer_bytes = 0
        self.free = 0
        self.needed = 0
        self.native: NativeFetcher | None = None
        self.started_listing = started
        self.journal: IO[str]
        self.manifest: IO[str]
        self.started = time.monotonic()
        self.thread_started = time.thread_time()

    def _open(self) -> tuple[bool, dict[str, ManifestEntry]]:
        """Make (or resume) the revision's directories: (whether a killed run is resumed, what it placed)."""
        rev = self.rev
        try:
            resuming = rev.prepare()
            known = rev.known_entries()
            st = os.statvfs(rev.data)
        except OSError as e:
            raise destination_error(e, rev.dir) from e
        self.free = st.f_bavail * st.f_frsize
        self.needed = 0
        return resuming, known

    # --- listing ------------------------------------------------------------

    def _plan(self, batch: list[RemoteObject], known: dict[str, ManifestEntry]) -> list[Task]:
        """Hash, check and record one listing page; the objects of it still to copy (space reserved)."""
        relative, hasher, progress = self.selection.relative, self.hasher, self.progress
        fetch: list[Task] = []
        for obj in batch:
            rel = relative(obj.key)
            if rel is None:
                continue  # outside the selection, or the prefix's own directory marker
            hasher.add(obj.key, obj.size, obj.etag, obj.version_id)
            if reason := unsafe_reason(rel):
                self.hostile.append((obj.key, reason))
                continue
            if obj.size == 0:
                # Maybe a directory marker; see _settle_empty. Either
                # way its parents are directories. Whether it sits at or
                # under a file is only known now, in listing order.
                self.shape.add_parents(rel)
                self.empties.append((obj, rel, self.shape.file_at_or_above(rel)))
                continue
            if clash := self.shape.clash(rel):
                self.hostile.append((obj.key, f"file and directory at once ({clash})"))
                continue
            if self.hostile:
                continue  # the run will fail; keep listing only to name every bad key
            old = known.get(rel)
            if old and _same(old, obj) and self.tree.is_current(rel, obj.size):
                self._list_entry(old)
                progress.skipped += 1
                continue
            # Listed now, fetched later: the run fails unless every
            # GET succeeds (If-Match: these very bytes), so the line
            # can be written before the file exists.
            line = self._list_entry(ManifestEntry(obj.key, rel, obj.size, obj.etag, obj.version_id))
            fetch.append((obj, rel, line))
        # Space is reserved a page at a time, so a short listing is
        # judged on its exact total before any of it is fetched.
        self._reserve([o for o, _, _ in fetch])
        return fetch

    def _unrepresentable(self, e: Exception, keys: list[str]) -> HostileKeysError:
        """The failure for a listing the client refused (``keys``: listed verbatim with boto3)."""
        for key in keys:
            rel = self.selection.relative(key)
            if rel and not key.endswith("/") and (reason := unsafe_reason(rel)):
                self.hostile.append((key, reason))
        return HostileKeysError(
            self._hostile_message() if self.hostile else f"a key under {self.source.uri} cannot be copied: {e}"
        )

    def _list_entry(self, entry: ManifestEntry) -> str:
        line = entry.to_json() + "\n"
        self.manifest.write(line)
        self.objects += 1
        self.bytes += entry.size
        return line

    def _reserve(self, objs: list[RemoteObject]) -> None:
        self.needed += sum(-(-o.size // BLOCK) * BLOCK for o in objs)
        self.progress.to_fetch_objects += len(objs)
        self.progress.to_fetch_bytes += sum(o.size for o in objs)
        if self.needed > self.free:
            more = "" if self.progress.listing_done else "at least "
            raise NoSpaceError(
                f"not enough space in {self.rev.c}: the objects still to copy need {more}"
                f"{self.needed} bytes ({human_bytes(self.needed)}) but only {self.free} bytes "
                f"({human_bytes(self.free)}) are free; free space on the node's cache disk (older "
                f"revisions are removed once no pod holds them), narrow the source with include/exclude, "
                f"or use a larger disk"
            )

    def _check_revision(self) -> None:
        got = self.hasher.revision_id()
        if got != self.rev.rev:
            raise RevisionGoneError(
                f"revision {self.rev.rev} of {self.source.uri} (the one this pod was admitted with) is no "
                f"longer in the bucket: it lists as revision {got} now ({self.hasher.objects} objects, "
                f"{self.hasher.bytes} bytes). Objects were changed, added or deleted after the revision was "
                f"pinned, so nothing was staged. {_revision_advice()}"
            )

    # --- empty objects --------------------------------------------------------

    def _listed_presence(self, obj: RemoteObject, rel: str) -> bool | None:
        """Whether empty object ``obj`` is a real object at ``rel`` as far as the listing tells:
        False for a marker of a directory filled anyway, the versioned listing's word, or None:
        only a HEAD can tell (a directory marker ``a/`` lists as ``a``; the caller asks, under
        the run's request limit)."""
        if self.shape.is_dir(rel):
            return False  # a directory marker of a directory we fill anyway
        if obj.version_id is not None:
            return not obj.marker  # a versioned listing keeps the key verbatim
        return None

    def _settle_empty(
        self, obj: RemoteObject, rel: str, above: str | None, known: dict[str, ManifestEntry], present: bool
    ) -> None:
        """Place empty object ``obj`` at ``rel`` (``present``: a real object, not a marker), or
        name its clash. Creating an empty file opens no connection."""
        if not present:
            return  # only "key/" exists: a directory marker of an empty directory, skipped quietly
        if above == rel or rel in self.placed_empties:
            return  # "key" and "key/" both exist; the real object already won
        if above is not None:
            self.hostile.append((obj.key, f"file and directory at once ({above})"))
            return
        old = known.get(rel)
        if old and _same(old, obj) and self.tree.is_current(rel, 0):
            self.placed_empties[rel] = old
            self.progress.skipped += 1
            return
        self.tree.ensure_parent(rel)
        tmp = os.path.join(self.rev.tmp, f"empty-{len(self.placed_empties)}-{id(obj)}")
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444))
        self.tree.place(tmp, rel)
        entry = ManifestEntry(obj.key, rel, 0, obj.etag, obj.version_id)
        self.placed_empties[rel] = entry
        self.journal.write(entry.to_json() + "\n")

    # --- copying ------------------------------------------------------------

    def _native_items(self, tasks: list[Task]) -> list[tuple[str, str, str, str | None, int]]:
        """Small objects as the native copier takes them (native.Item). Directories are made
        here, in listing order, as LocalTree records them for the seal; the native side only
        renames into them."""
        tree = self.tree
        items = []
        for obj, rel, _ in tasks:
            tree.ensure_parent(rel)
            items.append((obj.key, tree.path(rel), obj.etag, obj.version_id, obj.size))
        return items

    def _record_native(self, small: list[Task], placed: list[tuple[int, Fetched]]) -> None:
        """Journal what a native batch placed (even when the batch failed: a resumed run skips it)."""
        fetched = 0
        write = self.journal.write
        for i, got in placed:
            obj, rel, line = small[i]
            if got.size == obj.size and got.etag in ("", obj.etag):
                write(line)  # the object as listed: its manifest line, already encoded
            else:
                write(ManifestEntry(obj.key, rel, got.size, got.etag or obj.etag, obj.version_id).to_json() + "\n")
            fetched += got.size
        self.fetched_bytes += fetched
        self.progress.fetched_objects += len(placed)
        self.progress.add_bytes(fetched)

    def _record(self, obj: RemoteObject, rel: str, got: Fetched) -> None:
        """Journal one object fetched on its own."""
        entry = ManifestEntry(obj.key, rel, got.size, got.etag or obj.etag, obj.version_id)
        self.journal.write(entry.to_json() + "\n")
        self.fetched_bytes += got.size
        self.progress.fetched_objects += 1

    # --- the end ------------------------------------------------------------

    def _conclude(self, resuming: bool) -> tuple[str, StageSummary]:
        """Once every object is placed (the journal still open): fail on hostile keys, else the
        manifest's file and the summary, with what a killed run left that is not listed removed."""
        if self.hostile:
            raise HostileKeysError(self._hostile_message())
        manifest = self._final_manifest()
        # Only a resumed run can find files it did not place (a killed
        # run of an earlier listing); a fresh data dir holds none. This
        # is the one place that holds every path (a resume at 1M keys
        # costs ~100 MiB more, once).
        stale = self.tree.stale(set(_paths(manifest))) if resuming else []
        if stale:
            self.tree.remove(stale)
        return manifest, self._summary(len(stale))

    def _final_manifest(self) -> str:
        """The manifest's file: the listed lines, with the empty files merged in path order.

        Listing order is path order (keys in UTF-8 byte order; the prefix is
        common), so without empty files the listed file is the manifest as is.
        """
        if not self.placed_empties:
            return self.manifest_tmp
        merged = os.path.join(self.rev.tmp, "manifest.merged")
        empties = sorted(self.placed_empties.values(), key=lambda e: e.path)
        with open(self.manifest_tmp) as listed, open(merged, "w", buffering=1 << 16) as out:
            lines = ((ManifestEntry.from_json(line).path, line) for line in listed)
            extra = ((e.path, e.to_json() + "\n") for e in empties)
            for _, line in heapq.merge(lines, extra, key=lambda t: t[0]):
                out.write(line)
        os.unlink(self.manifest_tmp)
        self.objects += len(empties)
        return merged

    def _summary(self, deleted: int) -> StageSummary:
        return StageSummary(
            objects=self.objects,
            bytes=self.bytes,
            skipped=self.progress.skipped,
            fetched_bytes=self.fetched_bytes,
            deleted=deleted,
            seconds=time.monotonic() - self.started,
            revision=self.rev.rev,
            warm=False,
            fetched_objects=self.progress.fetched_objects,
            bucket_bytes=self.fetched_bytes - self.peer_bytes,
            peer_bytes=self.peer_bytes,
        )

    def _hostile_message(self) -> str:
        shown = "; ".join(f"{k!r} ({why})" for k, why in self.hostile[:MAX_KEYS_SHOWN])
        more = f" and {len(self.hostile) - MAX_KEYS_SHOWN} more" if len(self.hostile) > MAX_KEYS_SHOWN else ""
        return (
            f"{len(self.hostile)} object key(s) under {self.source.uri} cannot be written safely "
            f"under the cache dir: {shown}{more}; rename them in the bucket or exclude them "
            f"with an exclude glob"
        )

    def _failure(self, e: Exception) -> Exception:
        """What a failed run raises for ``e``: ``e`` itself, or the StageError (exit code) it
        means. A revision the bucket cannot serve any more is removed first."""
        if isinstance(e, RevisionGoneError):
            self._drop_revision()
            return e
        # Either S3 client's failures, told apart by kind (store.py): obstore is not imported
        # on the common path, so its classes cannot be named here.
        failed = kind(e)
        if isinstance(e, ObjectGone) or failed == "precondition":
            self._drop_revision()
            return RevisionGoneError(
                f"an object under {self.source.uri} changed or was deleted after revision {self.rev.rev} was "
                f"pinned ({_first_line(e)}); the bucket can no longer serve revision {self.rev.rev}, so nothing "
                f"was staged. {_revision_advice()}"
            )
        if isinstance(e, OSError):
            return destination_error(e, self.rev.dir)
        if failed is not None:
            return source_error(e, self.source, self.progress.fetched_objects)
        return e

    def _drop_revision(self) -> None:
        if self.native:
            self.native.close()  # no native thread may place a file while the revision is removed
        try:
            self.journal.close()
        except Exception:
            pass
        self.rev.remove()

    def _close(self) -> None:
        """Last, whether the run succeeded or not: stop the native plane, remove a half
        manifest, and the final progress report and notes."""
        if self.native:
            self.native.close()
            if (large := self.native.counters())["large_parts"] or large["parts_retried"]:
                self.progress.note(
                    f"native data plane: {large['large_objects']} large object(s) in {large['large_parts']} "
                    f"ranged parts, {large['parts_retried']} part(s) tried again"
                )
        # A failed run leaves no half manifest in tmp/ (a sealed one was moved out).
        for leftover in (self.manifest_tmp, os.path.join(self.rev.tmp, "manifest.merged")):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        self.progress.report()
        # The control plane runs on this one thread whatever the data plane's
        # threads: its CPU per object bounds objects/s on a big node
        # (bench/stager.py reads this line). Start-up is counted apart.
        self.progress.note(
            f"control plane: {time.thread_time() - self.thread_started:.3f} s CPU on the {self.control_thread} "
            f"(+{self.thread_started:.3f} s to start)"
        )


def _same(placed: ManifestEntry, listed: RemoteObject) -> bool:
    """A file a killed run placed is the listed object (same size, ETag and version)."""
    return (placed.size, placed.etag, placed.version_id) == (listed.size, listed.etag, listed.version_id)


def _paths(manifest: str) -> Iterator[str]:
    with open(manifest) as f:
        for line in f:
            yield ManifestEntry.from_json(line).path


def _revision_advice() -> str:
    return (
        "Pods admitted from now on get the bucket's current revision: re-run the Job (or delete its "
        "pending pods), or restore the objects. Data that must stay fixed while Jobs run belongs "
        "under a new prefix per version."
    )


def _first_line(e: BaseException) -> str:
    return (str(e) or type(e).__name__).split("\n")[0]


def destination_error(e: OSError, dest: str) -> StageError:
    if e.errno == errno.ENOSPC:
        return DestinationError(f"disk full while writing {dest}: free space on the node's cache disk and retry")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DestinationError(f"cannot write {dest}: {e.strerror}; the stager needs a writable cache volume")
    return DestinationError(f"writing {dest} failed: {e}")

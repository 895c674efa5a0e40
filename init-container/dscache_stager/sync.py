"""``dscache-stage sync``: make DEST an exact, complete copy of an S3 prefix."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from obstore.exceptions import BaseError, PermissionDeniedError, PreconditionError, UnauthenticatedError

from .errors import (
    DestinationError, HostileKeysError, NoSpaceError, SourceError, StageError, TransientError,
)
from .fetch import Fetcher, ObjectGone, exists
from .keys import Filters, TreeShape, unsafe_reason
from .layout import Entry, Layout
from .listing import RemoteObject, UnrepresentableKeys, list_keys_raw, list_objects
from .progress import Progress, human_bytes
from .source import S3Source
from .tree import LocalTree

BLOCK = 4096
MAX_KEYS_SHOWN = 20


def default_concurrency() -> int:
    # Requests in flight. Small objects are latency-bound (real S3 answers in
    # tens of ms), so many more than cores; memory stays under this x 1 MiB.
    return min(256, max(64, 32 * (os.cpu_count() or 2)))


@dataclass
class SyncOptions:
    source: S3Source
    dest: Path
    filters: Filters = field(default_factory=Filters)
    concurrency: int = field(default_factory=default_concurrency)
    progress_interval: float = 3.0

    def fingerprint(self) -> dict:
        """What a complete copy was made from; a copy is reusable only for the same."""
        return {"source": self.source.uri, "endpoint": self.source.endpoint_url,
                "include": self.filters.include, "exclude": self.filters.exclude}


@dataclass
class Summary:
    objects: int = 0
    bytes: int = 0
    skipped: int = 0
    fetched_bytes: int = 0
    deleted: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["seconds"] = round(self.seconds, 3)
        d["mb_s"] = round(self.fetched_bytes / 1e6 / self.seconds, 1) if self.seconds > 0 else 0.0
        return d


def sync(opts: SyncOptions, progress: Progress | None = None) -> Summary:
    progress = progress or Progress()
    layout = Layout(opts.dest)
    started = time.time()
    waited = False

    def on_wait() -> None:
        nonlocal waited
        waited = True
        progress.note(f"another stager is filling {opts.dest}; waiting for it")

    with layout.locked(on_wait):
        if waited and (reused := _reuse_fresh_copy(layout, opts, started)):
            progress.note(f"reusing the copy another stager just completed: {reused.objects} objects")
            return reused
        return asyncio.run(_Run(opts, layout, progress).run())


def _reuse_fresh_copy(layout: Layout, opts: SyncOptions, started: float) -> Summary | None:
    """A copy completed while we waited is as fresh as one we would make now."""
    marker = layout.read_complete()
    completed = layout.completed_at()
    if not marker or completed is None or completed < started or marker.get("fingerprint") != opts.fingerprint():
        return None
    return Summary(objects=marker["objects"], bytes=marker["bytes"], skipped=marker["objects"])


class _Run:
    def __init__(self, opts: SyncOptions, layout: Layout, progress: Progress) -> None:
        self.opts = opts
        self.source = opts.source
        self.layout = layout
        self.progress = progress
        self.tree = LocalTree(str(opts.dest))
        self.shape = TreeShape()
        self.entries: dict[str, Entry] = {}
        self.hostile: list[tuple[str, str]] = []
        self.empties: list[RemoteObject] = []
        self.fetched_bytes = 0
        self.modified = False
        self.started = time.monotonic()

    def _modifying(self) -> None:
        """Withdraw the completion marker before the first change to DEST.

        A sync that changes nothing never withdraws it, so training pods
        already reading a retained copy never see it flicker.
        """
        if not self.modified:
            self.layout.mark_incomplete()
            self.modified = True

    async def run(self) -> Summary:
        layout = self.layout
        try:
            layout.clear_tmp()
            known = layout.known_entries()
            st = os.statvfs(self.opts.dest)
        except OSError as e:
            raise _destination_error(e, str(self.opts.dest)) from e
        self.free = st.f_bavail * st.f_frsize
        self.needed = 0
        self.source.check_reachable()
        store = self.source.open_store(self.opts.concurrency)
        self.fetcher = Fetcher(store, self.tree, str(layout.tmp), asyncio.Semaphore(self.opts.concurrency),
                               self.progress.add_bytes, zero_copy=(self.source.endpoint_url or "").startswith("http://"))
        queue: asyncio.Queue[RemoteObject | None] = asyncio.Queue(maxsize=4 * self.opts.concurrency)
        workers = [self._worker(queue) for _ in range(self.opts.concurrency)]

        async def feed() -> None:
            await self._produce(store, known, queue)
            for _ in workers:
                await queue.put(None)

        ticker = asyncio.create_task(self._tick())
        try:
            with layout.open_journal() as self.journal:
                await _gather_or_cancel([asyncio.create_task(c) for c in (feed(), *workers)])
                await self._settle_empties(store, known)
                if self.hostile:
                    raise HostileKeysError(self._hostile_message())
                stale = self.tree.stale(set(self.entries))
                if stale:
                    self._modifying()
                    self.tree.remove(stale)
                summary = self._summary(len(stale))
                marker = layout.read_complete()
                if self.modified or not marker or marker.get("fingerprint") != self.opts.fingerprint():
                    self._modifying()
                    layout.mark_complete(sorted(self.entries.values(), key=lambda e: e.rel),
                                         {**summary.to_dict(), "fingerprint": self.opts.fingerprint()})
                return summary
        except OSError as e:
            raise _destination_error(e, str(self.opts.dest)) from e
        except BaseError as e:
            raise _source_error(e, self.source, self.progress.fetched_objects) from e
        finally:
            ticker.cancel()
            self.fetcher.close()
            self.progress.report()

    # --- listing ------------------------------------------------------------

    async def _produce(self, store, known: dict[str, Entry], queue: asyncio.Queue) -> None:
        accepts, relative, progress = self.opts.filters.accepts, self.source.relative, self.progress
        try:
            async for batch in list_objects(store, self.source.prefix):
                fetch: list[RemoteObject] = []
                for obj in batch:
                    rel = relative(obj.key)
                    if not rel or not accepts(rel):
                        continue  # the prefix's own directory marker, or filtered out
                    if reason := unsafe_reason(rel):
                        self.hostile.append((obj.key, reason))
                        continue
                    if obj.size == 0:
                        self.empties.append(obj)  # maybe a directory marker; see _settle_empties
                        continue
                    if clash := self.shape.clash(rel):
                        self.hostile.append((obj.key, f"file and directory at once ({clash})"))
                        continue
                    if self.hostile:
                        continue  # the run will fail; keep listing only to name every bad key
                    old = known.get(rel)
                    if old and old.size == obj.size and old.etag == obj.etag and self.tree.is_current(rel, obj.size):
                        self.entries[rel] = old
                        progress.skipped += 1
                        continue
                    fetch.append(obj)
                # Space is reserved a page at a time, so a short listing is
                # judged on its exact total before any of it is fetched.
                self._reserve(fetch)
                for obj in fetch:
                    await queue.put(obj)
        except UnrepresentableKeys as e:
            # obstore refused a key; list verbatim with boto3 to name them all.
            keys = await asyncio.to_thread(list_keys_raw, self.source)
            for key in keys:
                rel = relative(key)
                if rel and not key.endswith("/") and accepts(rel) and (reason := unsafe_reason(rel)):
                    self.hostile.append((key, reason))
            if not self.hostile:
                raise HostileKeysError(f"a key under {self.source.uri} cannot be copied: {e}") from e
        progress.listing_done = True

    def _reserve(self, objs: list[RemoteObject]) -> None:
        self.needed += sum(-(-o.size // BLOCK) * BLOCK for o in objs)
        self.progress.to_fetch_objects += len(objs)
        self.progress.to_fetch_bytes += sum(o.size for o in objs)
        if self.needed > self.free:
            more = "" if self.progress.listing_done else "at least "
            raise NoSpaceError(
                f"not enough space in {self.opts.dest}: the objects still to copy need {more}"
                f"{self.needed} bytes ({human_bytes(self.needed)}) but only {self.free} bytes "
                f"({human_bytes(self.free)}) are free; free space on the node's cache disk, "
                f"narrow the source with include/exclude, or use a larger disk")

    async def _settle_empties(self, store, known: dict[str, Entry]) -> None:
        """Empty objects: a real empty file, or a directory marker ``a/`` that obstore shows as ``a``."""
        async def settle(obj: RemoteObject) -> None:
            if not await exists(store, obj.key):
                return  # only "key/" exists: a directory marker, skipped quietly
            rel = self.source.relative(obj.key)
            if rel in self.entries:
                return  # "key" and "key/" both exist; the real object already won
            if clash := self.shape.clash(rel):
                self.hostile.append((obj.key, f"file and directory at once ({clash})"))
                return
            old = known.get(rel)
            if old and old.size == 0 and old.etag == obj.etag and self.tree.is_current(rel, 0):
                self.entries[rel] = old
                self.progress.skipped += 1
                return
            self._modifying()
            self.tree.ensure_parent(rel)
            tmp = os.path.join(self.layout.tmp, f"empty-{len(self.entries)}-{id(obj)}")
            open(tmp, "wb").close()
            os.chmod(tmp, 0o644)
            self.tree.place(tmp, rel)
            self._record(Entry(obj.key, rel, 0, obj.etag))

        await asyncio.gather(*(settle(o) for o in self.empties))

    # --- copying ------------------------------------------------------------

    async def _worker(self, queue: asyncio.Queue) -> None:
        fetcher, relative = self.fetcher, self.source.relative
        while (obj := await queue.get()) is not None:
            rel = relative(obj.key)
            self._modifying()
            try:
                got = await fetcher.fetch(obj.key, rel, obj.size, obj.etag)
            except ObjectGone:
                continue  # deleted since it was listed: it no longer belongs in the copy
            self._record(Entry(obj.key, rel, got.size, got.etag))
            self.fetched_bytes += got.size
            self.progress.fetched_objects += 1

    def _record(self, entry: Entry) -> None:
        self.entries[entry.rel] = entry
        self.journal.write(entry.to_json() + "\n")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.opts.progress_interval)
            self.journal.flush()  # a killed run loses at most one interval of records
            self.progress.report()

    # --- results ------------------------------------------------------------

    def _summary(self, deleted: int) -> Summary:
        return Summary(
            objects=len(self.entries), bytes=sum(e.size for e in self.entries.values()),
            skipped=self.progress.skipped, fetched_bytes=self.fetched_bytes, deleted=deleted,
            seconds=time.monotonic() - self.started,
        )

    def _hostile_message(self) -> str:
        shown = "; ".join(f"{k!r} ({why})" for k, why in self.hostile[:MAX_KEYS_SHOWN])
        more = f" and {len(self.hostile) - MAX_KEYS_SHOWN} more" if len(self.hostile) > MAX_KEYS_SHOWN else ""
        return (f"{len(self.hostile)} object key(s) under {self.source.uri} cannot be written safely "
                f"under the cache dir: {shown}{more}; rename them in the bucket or exclude them "
                f"with an exclude glob")


async def _gather_or_cancel(tasks: list[asyncio.Task]) -> None:
    """Wait for all tasks; on the first failure cancel the rest and re-raise it."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _destination_error(e: OSError, dest: str) -> StageError:
    if e.errno == errno.ENOSPC:
        return DestinationError(f"disk full while writing {dest}: free space on the node's cache disk and retry")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DestinationError(f"cannot write {dest}: {e.strerror}; the stager needs a writable cache volume")
    return DestinationError(f"writing {dest} failed: {e}")


def _source_error(e: BaseError, source: S3Source, fetched: int) -> StageError:
    text = str(e).split("\n")[0]
    where = f"{source.uri}" + (f" at {source.endpoint_url}" if source.endpoint_url else "")
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or "AccessDenied" in str(e) or "403" in text:
        return SourceError(f"access denied to {where}: check the credentials Secret (or the pod's IAM role) "
                           f"and that the bucket policy allows ListBucket and GetObject ({text})")
    if "NoSuchBucket" in str(e):
        return SourceError(f"no such bucket: {source.bucket} at {source.endpoint_url or 'AWS S3'}; "
                           f"check the bucket name, region and endpoint")
    if isinstance(e, PreconditionError):
        return TransientError(f"an object under {where} changed while it was being copied; re-run to copy the new version")
    if any(s in str(e) for s in ("error sending request", "Connection refused", "dns error", "connect")) and fetched == 0:
        return SourceError(f"cannot reach the S3 endpoint for {where}: check the endpoint URL and network policy ({text})")
    return TransientError(f"S3 kept failing for {where} after retries with backoff: {text}; re-run to resume")

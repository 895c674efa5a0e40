"""The native data plane: small objects GET, written and renamed in dscache_native (native/).

fetch.py measured the bound of the pure-Python path: every object crosses
from obstore's tokio threads to the asyncio thread twice, and all per-object
work but tokio's runs on that one thread (~0.5-0.7 ms per object, so about
1,500-2,000 objects/s whatever the cores). dscache_native does GET (If-Match
on the listed ETag, or the pinned versionId) -> temp file -> rename for a
whole batch on native threads with the GIL released, and completes to Python
once per batch. Python keeps the control plane (listing, revision hash,
hostile keys, journal, progress).

Large objects (issue 30) go down too, one call each: ranged GETs of PART_SIZE
in parallel on the native threads (at most SPLICE_THREADS parts in flight over
the copier, as fetch.py's splice threads), each part pinned as the small
objects are and written into a temp file sized up front (by splice(2) from a
presigned URL on a plain-HTTP endpoint, else streamed and written with
pwritev), then renamed; a failed or short part is tried again on its own. fetch.py's ranged
parts (splice on plain HTTP) stay the fallback when the extension is absent.

Small objects' files are written on the runtime's workers, between their GETs.
Handing the write off measured no faster and cost CPU (issue 30's second round,
3,000-5,000 x 64 KiB, bench/stager.py in the same run): on tokio's blocking
threads (spawn_blocking, at most twice the workers at once) 2.95 s against
3.16 s inline at 249 against 205 ms of CPU per 1,000 objects; with the worker
handed over (block_in_place) 2.78 against 2.79 s at 283 against 196 ms. On
these 2 shared cores the client's and the server's CPU is the bound, so the
writes stay inline.

Each body is written as its response's chunks came (one writev), not first
copied into one buffer of the object's size, and the unnamed file is linked by
its descriptor (linkat AT_EMPTY_PATH, allowed to the file's opener since Linux
6.10) rather than through /proc/self/fd (the fallback, found by the first link;
DSCACHE_NATIVE_LINK=proc forces it). Issue 30's third round could not tell
either apart from noise (3,000 x 64 KiB, six runs each in turns, load 16-33:
294, 282 with the /proc link and 287 ms of CPU per 1,000 objects before both;
s5cmd 503). What it could see (perf, same runs): on this machine's journal-less
ext4, 20-70% of the client's CPU is the kernel allocating inodes
(__ext4_new_inode: find_inode_bit skips every inode freed in the last 60 s whose
inode-table block is cached, from the start of the group, for each file), s5cmd
paying as much per file (63 against 95 us in one run); the stager's own code
(Python, the extension, libc) is a fifth to a third of it.

The extension is optional: when it is not installed (a venv without cargo),
or DSCACHE_NATIVE=0, the stager runs fetch.py's path, which stays the
reference: the test suite runs against both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

from .objects import OBJECT_ATTEMPTS, PART_SIZE, SMALL_LIMIT, SPLICE_THREADS, Fetched, ObjectGone
from .source import S3Source, credentials_for_store
from .store import ENV, failure
from .switches import env_flag
from .sync_options import BUFFER_BYTES

__all__ = ["ENV", "NativeFetcher", "handles", "load", "threads"]

#: How often a large object's progress is read from the copier while it is copied.
PROGRESS_S = 0.5

#: "0": small objects are written to a named temp file in tmp/ and renamed into place, as
#: before issue 30, instead of an unnamed file (O_TMPFILE) linked into its directory.
TMPFILE_ENV = "DSCACHE_NATIVE_TMPFILE"

#: "proc": unnamed files are linked through /proc/self/fd only, as on kernels before 6.10, not
#: by their descriptor (linkat AT_EMPTY_PATH) first; for tests of that way on newer kernels.
LINK_ENV = "DSCACHE_NATIVE_LINK"

#: (key, final path, ETag, versionId, listed size) as dscache_native.Copier.fetch takes them.
Item = tuple[str, str, str, str | None, int]


def load() -> ModuleType | None:
    """dscache_native, unless it is absent or switched off (store.load_native, which the access
    proof uses)."""
    from .store import load_native

    return load_native()


def threads(cpus: int) -> int:
    """Native threads: one per CPU the container may use (cpus.available_cpus), unless
    DSCACHE_NATIVE_WORKERS says otherwise (bench/stager.py's --workers sweep)."""
    try:
        return max(1, int(os.environ["DSCACHE_NATIVE_WORKERS"]))
    except (KeyError, ValueError):
        return cpus


def handles(size: int) -> bool:
    """Objects the native path copies in batches: whole GETs held in memory, as fetch.py's small ones.
    Larger ones go one at a time, in ranged parts (NativeFetcher.fetch_large)."""
    return 0 < size <= SMALL_LIMIT


class NativeFetcher:
    """A dscache_native.Copier for one run, and the threads that wait on its batches."""

    def __init__(
        self,
        module: ModuleType,
        source: S3Source,
        concurrency: int,
        workers: int,
        tmp_dir: str,
        buffer_bytes: int = BUFFER_BYTES,
        part_bytes: int = PART_SIZE,
        config: dict[str, str] | None = None,
        splice: bool | None = None,
    ) -> None:
        self.tmp_dir = tmp_dir
        self.part_bytes = part_bytes
        # Batches small enough that a slow object holds back few others, many
        # enough in flight that the requests limit (not the batching) bounds
        # the GETs: about twice --concurrency objects are handed down at once.
        self.batch_size = max(8, min(64, concurrency // 4))
        self.batches = max(2, 2 * concurrency // self.batch_size)
        self.copier: Any = module.Copier(
            source.bucket,
            {**source.store_settings(concurrency), **(config or {})},
            **_credentials(),
            workers=workers,
            concurrency=concurrency,
            buffer_bytes=buffer_bytes,
            attempts=OBJECT_ATTEMPTS,
            parts=SPLICE_THREADS,
            # Plain HTTP, as fetch.py decides it: large objects' parts by splice(2) (native/src/splice.rs).
            splice=(source.endpoint_url or "").startswith("http://") if splice is None else splice,
            # Small objects into unnamed files (O_TMPFILE) linked into place; "0": temp + rename
            # in tmp/ (bench/stager.py measures both).
            tmpfile=env_flag(TMPFILE_ENV, True),
            link_proc=os.environ.get(LINK_ENV, "").strip().lower() == "proc",
        )
        self.workers: int = self.copier.workers
        self.reported = 0  # large parts' bytes handed to on_bytes so far
        # Each batch blocks one of these threads in native code, without the GIL.
        self.pool = ThreadPoolExecutor(self.batches, thread_name_prefix="native-batch")
        self.closed = False

    async def fetch(
        self, items: list[Item], grow: list[str] | None = None
    ) -> tuple[list[tuple[int, Fetched]], BaseException | None]:
        """Copy a batch on a thread of the pool; (index, Fetched) of each object placed, and the
        failure that stopped the rest. ``grow``: per item, the temp file its body is written into
        as it comes, for the node agent to pass on to peers meanwhile ("": written whole)."""
        import asyncio  # here, not at the top: onepage.py uses this module without asyncio

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.fetch_blocking, items, grow)

    def fetch_blocking(
        self, items: list[Item], grow: list[str] | None = None
    ) -> tuple[list[tuple[int, Fetched]], BaseException | None]:
        """:meth:`fetch` on this thread: the copier bounds its own requests and buffers, so a
        whole listing page may be handed down at once (onepage.py)."""
        done, failure = self.copier.fetch(self.tmp_dir, items, grow or [])
        placed = [(i, Fetched(size, etag)) for i, size, etag in done]
        return placed, (_exception(*failure) if failure is not None else None)

    async def fetch_large(self, item: Item, on_bytes: Callable[[int], None] | None = None, grow: str = "") -> Fetched:
        """Copy one large object in ranged parts and place it; raises as fetch.Fetcher.fetch does.

        The object completes to Python once; meanwhile ``on_bytes`` hears of its parts as they are
        written (every PROGRESS_S, from the copier's byte counter, shared by the objects in flight).
        """
        import asyncio

        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self.pool, self.fetch_large_blocking, item, grow)
        if on_bytes is not None:
            while not job.done():
                await asyncio.wait({job}, timeout=PROGRESS_S)
                self.report_large(on_bytes)
        return await job

    def fetch_large_blocking(self, item: Item, grow: str = "") -> Fetched:
        """:meth:`fetch_large` on this thread, without progress (onepage.py runs it on the pool's
        threads and reads :meth:`report_large` itself). ``grow``: the object's grow file, so that
        the node agent passes it on as its parts land ("": a temp file, passed on once whole)."""
        done, failure = self.copier.fetch_large(self.tmp_dir, item, self.part_bytes, grow)
        if failure is not None:
            raise _exception(*failure)
        size, etag = done
        return Fetched(size, etag)

    def report_large(self, on_bytes: Callable[[int], None]) -> None:
        """Hand ``on_bytes`` the large parts' bytes written since the last call."""
        written = self.copier.counters()["large_bytes"]
        if written > self.reported:
            on_bytes(written - self.reported)
            self.reported = written

    def counters(self) -> dict[str, int]:
        """Large objects placed, parts written and parts tried again by this copier."""
        return dict(self.copier.counters())

    def close(self) -> None:
        """Stop every batch and wait for their threads: after this nothing more is written or renamed."""
        if self.closed:
            return
        self.closed = True
        self.copier.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _exception(kind: str, errno: int, message: str, key: str) -> BaseException:
    """A native failure as the exception fetch.py raises for it (of the same store.kind as
    obstore's), so sync.py maps it to the same exit code."""
    if kind == "gone":
        return ObjectGone(key)
    if kind == "os":
        return OSError(errno, os.strerror(errno), message)
    if kind == "cancelled":
        import asyncio

        return asyncio.CancelledError()
    return failure(kind, message)


def _credentials() -> dict[str, Any]:
    """credentials_for_store()'s answer as dscache_native.Copier's keyword arguments."""
    creds = credentials_for_store()
    if creds.get("skip_signature"):
        return {"skip_signature": True}
    if "credential_provider" in creds:
        provider = creds["credential_provider"]

        def call() -> tuple[str, str, str | None, float]:
            # obstore's Boto3CredentialProvider: a dict with an expiry; boto3 refreshes underneath.
            c = provider()
            expires = c.get("expires_at")
            valid = (expires - datetime.now(UTC)).total_seconds() if expires else 3600.0
            # An empty session token is none (an STS may answer <SessionToken/>): botocore then
            # sends no x-amz-security-token, and so must we, or the server refuses with a 400.
            return c["access_key_id"], c["secret_access_key"], c.get("token") or None, valid

        return {"credential_provider": call}
    return {
        "access_key_id": creds["access_key_id"],
        "secret_access_key": creds["secret_access_key"],
        "session_token": creds.get("session_token") or None,
    }

"""The data plane: GET objects into temp files with obstore.

Measured on this 2-core VM against a loopback versitygw, 4,000 x 64 KiB,
with the server on the same cores:
 - obstore (Rust object_store, asyncio, pooled keep-alive connections): 1.1 s,
   ~0.3 ms CPU per object in our process, most of it the kernel creating files;
 - awscrt S3 client writing bodies to files in C: 1.1 s, about the same;
 - s5cmd v2.3.0 defaults: 1.75-2.0 s;
 - boto3: ~1.5 ms CPU per get_object before any file I/O (anchors brief).
obstore and awscrt tie on small objects. obstore wins on the rest: ranged GETs
with If-Match we can pwrite ourselves, listing (see listing.py), retries with
jittered backoff built in, and a 4 ms import where boto3 takes 300 ms.

What bounds the CPU per small object (issue 9; measured 4,000 x 64 KiB on
loopback, strace -c and perf stat, the machine shared with a CI run): our user
CPU is below s5cmd's (0.65-0.99 s against 1.0-1.12 s) and our system CPU above
it (1.9-3.5 s against 0.95-1.7 s, varying with the other load; through the
20 ms proxy, 2,000 objects: 0.47-1.0 s against 0.52-0.83 s). The
excess is the hand-off between obstore's tokio threads and this asyncio
thread: 12 context switches and ~33 futex calls per object against s5cmd's
4.6 switches. Each object completes twice across threads (get_async, then
bytes_async), and each completion takes the GIL from a tokio thread and wakes
the loop through its self-pipe. obstore has no single call that GETs with
If-Match and returns the body (get_range_async takes no options, and the
revision pin needs If-Match), and a shorter GIL switch interval (0.5 ms)
measured no different. Halving the hand-offs needs native code that does
GET + write per object off the GIL (a maturin extension; not built). Creating
files costs every tool alike, and ten times more when the shared disk is busy.
strace -c -f of one cold run (3,000 x 64 KiB, loopback, load 5-11), per object:
33 futex calls (97% of syscall time: the GIL and tokio hand-offs above), 3
epoll_wait, 2 sendto (asyncio's self-pipe, once per cross-thread completion),
2 mmap + 2 munmap (obstore's body buffers), 1 openat, 1 rename. Two variants
measured no different within the noise (CPU per 1,000 objects 410-930 ms for
each, varying with the load): obstore's blocking calls from 8 or 32 threads
instead of asyncio, and MALLOC_MMAP_THRESHOLD_=4 MiB against the mmap pairs.

What bounds the speed, then (bench/stager.py prints it per profile): here the
S3 server (and, at 20 ms, the latency proxy) share our 2 cores, so a copy
takes at least (client + server + proxy CPU per object) / cores; the full run
of 2026-11-23 took 14-26% longer than that floor for both dscache and s5cmd, in both
profiles. Against a remote S3 only our share is on the node, and all of it
but tokio's part runs on this one asyncio thread: about 0.5-0.7 ms per object,
so roughly 1,500-2,000 objects/s whatever the cores or the requests in flight.
Past that, the next step is the native GET + write above, or one such loop
per core (the listing sharded over processes).

That native step is built now (issue 18; native.py and native/): small
objects go through dscache_native when it is installed and DSCACHE_NATIVE is
not 0. This module stays the reference path and the fallback.

Large objects went native too (issue 30; native/src/large.rs): the same
PART_SIZE parts, SPLICE_THREADS in flight, splice(2) on plain HTTP, pinned and
renamed as here, one completion per object. Per 256 MiB object (2 x 256 MiB
from loopback versitygw, strace -c -f, minus a one-object run): 6,526 syscalls
here (5,479 futex: the splice threads and the GIL) against 1,170 native (661
splice, 118 futex); CPU the same (~90 ms, nearly all the kernel's page-cache
copy), and so is the speed: the server and the fixed start-up bound it here.
Measured again in issue 30's second round (2 x 256 MiB, loopback versitygw,
load 7-20, minus a 1 KiB run): 1,090 syscalls per object native (606 splice,
114 futex, 16 connect: one connection per 16 MiB part) and 85 ms of CPU
against 100 ms here (medians of 5, user + sys). The bench's gap to the
server's ceiling is the start-up, not the parts: a 1 KiB copy costs ~0.1 s of
CPU before its first GET (perf: 59% libpython running imports, 30% the
kernel; the Rust extensions 2%), and on 2 shared cores that CPU is wall time.

Issue 30's third round (2 x 256 MiB from loopback versitygw, load 4-30, the
machine shared with four other benchmarking sessions):
 - Why the Python plane beat the native one in a recorded bench run (0.49 s
   against 0.588 s): it does not, in the data phase. Both splice the same 16
   parts in flight; called directly (Copier.fetch_large against curl's same
   ranged GETs into /dev/null, interleaved, medians of 7) the native data
   phase took 0.291 s against curl's 0.323 s, at 0.172 s of CPU against
   curl's 0.130 (the difference is the page-cache copy curl does not make).
   End to end, dscache-stage alternating the planes 8 times: native 0.36-0.42 s
   (median ~0.40) against 0.38-0.46 s (~0.43) at 0.26-0.30 s of CPU each; the
   bench's own rotation gave one run in each order (0.42 native, 0.41-0.52
   python) and a 0.1 s gap in others at load 4-16, which a repeat at load 8
   reversed: the planes differ by less than the load does.
 - What then bounds large_vs_ceiling is the start-up, not the parts: a copy is
   the ceiling plus the fixed cost (process start to first GET ~0.1-0.2 s of
   wall, 0.1 s of CPU), so at 2 x 256 MiB (ceiling ~0.3 s) the ratio stays near
   0.6-0.7 until that cost shrinks; at the full bench's 2 x 1 GiB the same
   cost is a quarter as large a share.
 - The parts (same-run sweep, native data phase, medians of 5-7): 16 MiB x
   16 in flight 0.291 s, server CPU 0.24 s; 32 MiB x 16 0.266 s, 0.18 s;
   32 MiB x 8 0.270 s, 0.19 s; 16 MiB x 8 0.362 s, 0.25 s; 64 MiB x 8
   0.476 s, 0.42 s (versitygw spends twice the CPU on 64 MiB ranges); one
   256 MiB object alone: 16 MiB 0.167 s, 32 MiB 0.142 s, 64 MiB 0.241 s
   (load 6-8). Repeated at load 15-20 the walls tied (0.271 against 0.280 s;
   one object 0.159 against 0.152 s) while the server's CPU fell as before
   (0.23 to 0.18 s; 0.11 to 0.09 s): four sweeps, the same saving each time.
   So PART_SIZE is 32 MiB; curl's GETs moved alike (16 MiB 0.309 s, 32 MiB x 8
   0.283 s; server CPU 0.22 to 0.17 s), so the bench's ceiling, built from
   PART_SIZE, moves with it. One connection per part stays: at 32 MiB that is
   8 connects per 256 MiB object, next to 600 splice calls.
 - Streaming (pwritev of object_store's buffers) instead of splice: the same
   wall within the noise, 0.23 s of CPU against 0.17 s.
 - Per 256 MiB object (strace -c -f of one object minus a 1 KiB copy):
   native 994 syscalls at 16 MiB parts (572 splice, 16 connect) and 720 at
   32 MiB (618 splice, 8 connect, 8 threads instead of 16); this path 5,844
   (4,706 futex) and 4,880 (4,047 futex). CPU per object ~0.07-0.1 s either
   way (user + sys of a one-object copy minus a 1 KiB one), nearly all the
   kernel's copy into the page cache.
 - Not the cause, measured: Copier start-up (3 ms, TLS roots included), the
   fsync policy (nothing is fsynced), dirty-page writeback (512 MiB stays under
   the dirty thresholds), fallocate (not used: see _fetch_parts).

Issue 30's large35 round (2 x 256 MiB from loopback versitygw; the machine shared with other
benchmarking sessions at load 30-90, so CPU is the figure, walls are noise):
 - Where the time between process start and the first ranged GET went (strace -f -ttt, page
   cache dropped): a large object sent the copy to sync.py, so after the listing answered
   the run imported asyncio, ssl, subprocess, sync.py, fetch.py... before its first part:
   listing to first part's connect 74-460 ms at load 40. onepage.py now copies a one-page
   revision's large objects too (NativeFetcher.fetch_large_blocking on the pool's threads):
   33-63 ms, the rest scheduling delay at that load (no syscall in the gap). Bench, same run
   (load 60-77, medians of 7): client CPU 0.258 s against 0.279 s through sync.py
   (dscache_sync, --large-variants), server CPU equal (0.19 s); curl's ceiling 0.145 s.
   Walls, bench/stager.py --quick --sets large --large-variants dscache_sync, medians of 7
   at load 15-29: dscache 0.928 s, 0.80x the ceiling (0.744 s), through sync.py 1.176 s
   (0.63x), s5cmd 1.538 s (0.48x); of 11 at load 48-97: 0.72x, 0.51x, 0.47x. The ratio
   still moves with the load more than with anything here: the ~0.1 s of CPU a stager
   spends starting (cli, imports; not this module's) is wall time on 2 shared cores.
 - The data phase (a direct NativeFetcher.fetch_large of both objects against curl's same
   ranged GETs into /dev/null, interleaved, medians of 5, client CPU / server CPU):
   32 MiB x 16 in flight 0.163/0.19 s (curl 0.149/0.16); x 8 0.169/0.19; x 4 0.160/0.20;
   64 MiB x 8 0.158/0.49 and 128 MiB x 4 0.175/0.58 (versitygw again spends 2-3x its CPU on
   our large ranges, not on curl's: curl's 64 MiB x 8 0.16-0.21 s with or without If-Match
   and Connection: close). The splice pipe: 1 MiB (pipe-max-size here) 0.163, 256 KiB
   0.243, 64 KiB 0.335 s; SPLICE_F_MORE no different (0.175); recv into a 1 MiB buffer +
   pwrite instead of splice 0.212 s. So the parts, the pipe and splice stay as they were:
   the client's data phase is within ~15 ms of CPU of curl's, which writes nothing, and what
   was left to take from large_s was the start-up path above.
 - strace -c -f of the whole copy (2 objects, start-up included, medians of 3): 4,369
   syscalls through onepage.py against 5,204 through sync.py; a 1 KiB revision the same
   way 2,484 against 3,329. So per large object ~940 either way (~630 splice, 58-84 futex):
   what went is the start-up's ~850 (sync.py's imports), not anything per object.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING

from . import rawhttp
from .objects import OBJECT_ATTEMPTS, PART_SIZE, SMALL_LIMIT, SPLICE_THREADS, Fetched, ObjectGone
from .store import GenericError, PermissionDeniedError, PreconditionError, kind
from .tree import LocalTree

if TYPE_CHECKING:
    # obstore is imported where this path first makes a request (Fetcher.store): on the common
    # path the native plane copies, and a cold start does not load obstore (store.py).
    from obstore import Bytes, GetOptions, GetResult
    from obstore.store import S3Store


#: S3 failures (store.kind) another try cannot mend; ObjectGone is one too.
FATAL_KINDS = ("permission", "unauthenticated", "precondition")


def _worth_retrying(e: BaseException) -> bool:
    """An S3 client's failure that may pass (a dropped connection, a 5xx past the client's retries)."""
    failed = kind(e)
    return failed is not None and failed not in FATAL_KINDS


async def get(store: S3Store, key: str, options: GetOptions | None = None) -> GetResult:
    import obstore

    try:
        return await obstore.get_async(store, key, options=options)
    except FileNotFoundError as e:
        raise ObjectGone(key) from e


# Files are born read-only: a complete revision must not change, and this
# saves a chmod pass over every file when it is sealed (layout.Revision.seal).
FILE_MODE = 0o444


class Fetcher:
    """Downloads objects into temp files under ``tree``'s tmp dir and moves them into place."""

    def __init__(
        self,
        store: Callable[[], S3Store],
        tree: LocalTree,
        tmp_dir: str,
        requests: asyncio.Semaphore,
        on_bytes: Callable[[int], None],
        zero_copy: bool,
    ) -> None:
        self._open = store  # obstore's client, opened at this path's first request (store)
        self._store: S3Store | None = None
        self.zero_copy = zero_copy and rawhttp.available()
        self.splicers = ThreadPoolExecutor(SPLICE_THREADS, thread_name_prefix="splice")
        self.tree = tree
        self.tmp_dir = tmp_dir
        self.requests = requests
        self.on_bytes = on_bytes
        self._seq = 0
        # Ranged parts written by splice(2) and by streaming: evidence of which
        # path a large object took (tests assert on it; it is in no summary).
        self.spliced_parts = 0
        self.streamed_parts = 0

    @property
    def store(self) -> S3Store:
        """obstore's client: the run's own when it is obstore's, else opened on first use (on
        the common path only peers' turns and the fallback reach it)."""
        if self._store is None:
            self._store = self._open()
        return self._store

    def close(self) -> None:
        # Splice threads own their descriptors, so they need not be waited for.
        self.splicers.shutdown(wait=False, cancel_futures=True)

    def _tmp_path(self) -> str:
        self._seq += 1
        return os.path.join(self.tmp_dir, f"{os.getpid()}-{self._seq}")

    async def fetch(self, key: str, rel: str, size: int, etag: str, version: str | None = None) -> Fetched:
        """Fetch ``key`` (that ``version`` of it, in a versioned bucket) and place it at ``rel``,
        whole or not at all.

        Every GET carries If-Match with the listed ETag: the bytes placed are
        the pinned revision's, or the fetch fails (PreconditionError).
        """
        for attempt in range(1, OBJECT_ATTEMPTS + 1):
            tmp = self._tmp_path()
            try:
                if size <= SMALL_LIMIT:
                    return await self._fetch_whole(key, rel, tmp, etag, version)
                got = await self._fetch_parts(key, size, etag, tmp, version)
                self._place(tmp, rel)
                return got
            except BaseException as e:
                _unlink_quietly(tmp)
                if not _worth_retrying(e) or attempt == OBJECT_ATTEMPTS:
                    raise
                await asyncio.sleep(random.uniform(0, 0.2 * 2**attempt))
        raise AssertionError("unreachable")

    async def _fetch_whole(self, key: str, rel: str, tmp: str, etag: str, version: str | None) -> Fetched:
        async with self.requests:
            result = await get(self.store, key, options=_pinned({}, etag, version))
            data = await result.bytes_async()
        # Written inline on the event loop: handing files to writer threads
        # measured no faster (2-8 threads, 4,000 x 64 KiB, 6 runs each).
        self._write_and_place(tmp, data, rel)
        self.on_bytes(len(data))
        return Fetched(len(data), (result.meta.get("e_tag") or "").strip('"'))

    def _write_and_place(self, tmp: str, data: Bytes, rel: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        self._place(tmp, rel)

    def _place(self, tmp: str, rel: str) -> None:
        self.tree.ensure_parent(rel)
        self.tree.place(tmp, rel)

    async def _fetch_parts(self, key: str, size: int, etag: str, tmp: str, version: str | None) -> Fetched:
        """Parallel ranged GETs written in place.

        If-Match pins every part to the listed ETag, so an object replaced
        mid-download fails instead of being stitched from two versions.
        Every part runs to its end (or error) before the file is closed.
        """
        # No fallocate: ext4 then converts unwritten extents on every write,
        # which cost 0.3 s per 512 MiB here; the space check ran before.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        try:
            # A presigned URL cannot name a version (its query is signed), so a
            # pinned version streams through obstore instead of splice(2).
            if self.zero_copy and version is None:
                import obstore

                url = await obstore.sign_async(self.store, "GET", key, timedelta(hours=6))
                part = functools.partial(self._splice_part, url, fd, etag)
            else:
                part = functools.partial(self._stream_part, key, fd, etag, version)
            ranges = [(s, min(s + PART_SIZE, size)) for s in range(0, size, PART_SIZE)]
            results = await asyncio.gather(*(part(s, e) for s, e in ranges), return_exceptions=True)
            if errors := [r for r in results if isinstance(r, BaseException)]:
                raise errors[0]
        finally:
            os.close(fd)
        return Fetched(size, etag)

    async def _stream_part(self, key: str, fd: int, etag: str, version: str | None, start: int, end: int) -> None:
        options = _pinned({"range": (start, end)}, etag, version)
        async with self.requests:
            result = await get(self.store, key, options=options)
            offset = start
            async for chunk in result.stream(min_chunk_size=1 << 20):
                os.pwrite(fd, chunk, offset)
                offset += len(chunk)
                self.on_bytes(len(chunk))
        if offset != end:
            raise GenericError(f"short read of {key} bytes {start}-{end}: got {offset - start}")
        self.streamed_parts += 1

    async def _splice_part(self, url: str, fd: int, etag: str, start: int, end: int) -> None:
        for attempt in range(1, OBJECT_ATTEMPTS + 1):
            # The thread gets its own descriptor, so it can never write
            # through a number this coroutine has closed and the OS reused.
            own = os.dup(fd)
            job = self.splicers.submit(_splice_owned, url, start, end, own, etag)
            job.add_done_callback(functools.partial(_close_if_cancelled, own))
            try:
                async with self.requests:
                    await asyncio.wrap_future(job)
                self.on_bytes(end - start)
                self.spliced_parts += 1
                return
            except rawhttp.HttpStatus as e:
                if e.status == 404:
                    raise ObjectGone(url) from e
                if e.status in (401, 403):
                    raise PermissionDeniedError(str(e)) from e
                if e.status == 412:
                    raise PreconditionError(str(e)) from e
                # 5xx, 429 and a 206 with the wrong framing are worth another try.
                if (e.status < 500 and e.status not in (206, 429)) or attempt == OBJECT_ATTEMPTS:
                    raise GenericError(str(e)) from e
            except rawhttp.PeerError as e:
                if attempt == OBJECT_ATTEMPTS:
                    raise GenericError(str(e)) from e
            await asyncio.sleep(random.uniform(0, 0.2 * 2**attempt))


def _pinned(options: GetOptions, etag: str, version: str | None) -> GetOptions:
    """``options`` plus what pins the bytes: If-Match on the listed ETag, and the version if any."""
    if etag:
        options["if_match"] = f'"{etag}"'
    if version is not None:
        options["version"] = version
    return options


def _close_if_cancelled(fd: int, job: Future[None]) -> None:
    # A job cancelled before it started never ran _splice_owned, which owns fd.
    if job.cancelled():
        os.close(fd)


def _splice_owned(url: str, start: int, end: int, fd: int, etag: str) -> None:
    try:
        rawhttp.get_range_into(url, start, end, fd, etag)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

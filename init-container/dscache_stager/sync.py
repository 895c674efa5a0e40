"""The cold path of ``dscache-stage sync``: list, check, copy and seal one revision.

stage.py runs the whole command (access proof, lock, lease, warm start; see
its docstring); this module is imported only when the revision is not on the
node yet and is more than one small listing page (onepage.py copies those;
asyncio alone costs a start ~20 ms, ~40 after a page-cache drop). Here: list
(streamed, hashed with the contract's RevisionHasher), GET with If-Match, write
into C/revs/<rev>; if the listing is not revision <rev> any more, or an object
changed under us, remove the incomplete revision and fail (exit 9): the pod
never sees a mix of two versions. A revision pinned in a versioned bucket
(--as-of) is found among the bucket's versions and fetched by versionId, so
overwrites and deletes after the pin do not matter while the versions last.
What is done with each object, the checks, the journal and the errors are
copyrun.CopyRun's, shared with onepage.py; this module adds asyncio's
orchestration (the listing a page ahead, batches in flight) and the peers.
A complete revision is never modified: a newer one is staged beside it.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any

from dscache_contract import ManifestEntry, Selection, StageSummary

from . import native, trace
from .copyrun import CopyRun, Task
from .cpus import available_cpus
from .fetch import Fetcher
from .layout import Revision
from .listing import boto3_client, boto3_error, list_keys_raw, list_objects, list_versions
from .listpage import Started
from .objects import SMALL_LIMIT, RemoteObject, UnrepresentableKeys
from .peers_pace import Pace
from .progress import Progress
from .source import S3Source
from .store import NativeStore, exists
from .sync_options import BUFFER_BYTES, SyncOptions
from .trace import mark

if TYPE_CHECKING:
    from obstore.store import S3Store

    from .peer_listing import ListingWriter
    from .peer_native import NativePeers
    from .peers import Obtained, Peers
    from .store import AnyStore

#: Objects waiting for the peer workers past which the listing pauses (the bucket's workers never
#: wait on the peer workers: issue 30 traced a stall of every node to that wait).
PEER_BACKLOG = 16384
#: While every object the native peer worker may have in flight is, it waits this long once for
#: more of them to end before it asks for the next ones (a batch, not one call per object).
PEER_GATHER_S = 0.005
#: Objects the peer workers send to the bucket are gathered this long into one native batch.
BUCKET_GATHER_S = 0.01
#: How long a root's "not come to it yet" for one key holds for the keys after it, unless that key
#: is asked again meanwhile (it is, every ROOT_PAUSE_MAX_S and jitter at most).
BEHIND_S = 0.5


# One object for a copier: (object, path under data/, its manifest line), or None: no more work.
Work = Task | None
# An object for the native peer worker: the task, which node of its chain to ask (0: its parent),
# the pause before the root is asked again if it has not come to the object yet, when (monotonic)
# it was first asked, per peer when its patience for the object ends (None until one held a
# request for it without sending), and the hops that did so (peers.obtain's "slow").
_Ask = tuple[Task, int, float, float, dict[str, float] | None, frozenset[str]]


def cold(
    opts: SyncOptions,
    rev: Revision,
    store: AnyStore,
    progress: Progress,
    started: Started | None = None,
) -> StageSummary:
    """Stage ``rev`` from the bucket (called by stage.sync with C's lock held); ``started``: the
    listing stage.prove_access began (its first page and the rest of its stream), to go on from.

    A page listed before the lock was taken is as good as one listed after it: the whole listing
    must still hash to ``rev`` (else exit 9) and every GET still carries If-Match.
    """
    return asyncio.run(_Run(opts, rev, store, progress, started).run())


def current_revision(source: S3Source, selection: Selection) -> dict[str, Any]:
    """List the source now and return its revision, pinned as the operator would pin it."""
    from botocore.exceptions import BotoCoreError, ClientError

    from dscache_contract import pin

    source.check_reachable()
    try:
        pinned = pin(boto3_client(source), source.bucket, selection)
    except (BotoCoreError, ClientError) as e:
        raise boto3_error(e, source) from e
    out: dict[str, Any] = {"revision": pinned.revision, "objects": pinned.objects, "bytes": pinned.bytes}
    if pinned.as_of is not None:
        out["as_of"] = pinned.as_of
    return out


class _Run(CopyRun):
    """The copy on asyncio: the listing streamed a page ahead, batches in flight, peers."""

    def __init__(
        self, opts: SyncOptions, rev: Revision, store: AnyStore, progress: Progress, started: Started | None = None
    ) -> None:
        super().__init__(opts, rev, store, progress, started)
        # Fetch once per cluster (peers.py): with the agent and the cache's token, objects other
        # nodes hold or copy are taken from them, and the bucket read only at this node's turn.
        self.peers: Peers | None = None
        if opts.agent and opts.cache and opts.peer_token_file:
            # Imported with peers only: peers.py brings http.client and email (~20 modules) to a cold start.
            from .peers import Peers

            self.peers = Peers(opts.agent, opts.cache, rev.rev, opts.peer_token_file)
        self.peer_queue: asyncio.Queue[Work] | None = None
        self.peer_native: NativePeers | None = None
        self.peers_known = asyncio.Event()
        self.pace = Pace()
        self.claims: IO[str] | None = None
        self._claims_lock = threading.Lock()  # the loop and the peer threads append
        self._peer_seq = 0
        self._peer_seq_lock = threading.Lock()
        # Objects the peer workers read from the bucket after all, gathered into native batches.
        self._to_bucket: list[tuple[Task, asyncio.Future[None]]] = []
        self._bucket_batches: set[asyncio.Future[None]] = set()
        # The listing this node lists for its peers, ahead of its copy (peer_listing.ahead writes
        # it, and puts it in place once it hashed to the revision).
        self.listing_writer: ListingWriter | None = None

    async def run(self) -> StageSummary:
        rev = self.rev
        resuming, known = self._open()
        # Python's own requests (fetch.py: every object on the Python plane, the large ones'
        # parts on the native plane, HEADs of empty objects) hold a body of up to 1 MiB, or a
        # 1 MiB chunk of a part, each and have no byte budget: as many as BUFFER_BYTES holds.
        # The native plane bounds its bodies by bytes itself, so it runs --concurrency.
        requests = min(self.opts.concurrency, BUFFER_BYTES // SMALL_LIMIT)
        self.requests = asyncio.Semaphore(requests)
        self.fetcher = Fetcher(
            self._python_store,
            self.tree,
            rev.tmp,
            self.requests,
            self.progress.add_bytes,
            zero_copy=(self.source.endpoint_url or "").startswith("http://"),
        )
        queue: asyncio.Queue[Work] = asyncio.Queue(maxsize=4 * self.opts.concurrency)
        if module := native.load():
            # Small objects: GET, write and rename in native code on one thread
            # per CPU the container may use, a batch at a time (native.py).
            self.native = native.NativeFetcher(
                module, self.source, self.opts.concurrency, native.threads(available_cpus()), rev.tmp
            )
            self.progress.note(f"native data plane: {self.native.workers} threads, batches of {self.native.batch_size}")
            workers = [self._native_worker(queue) for _ in range(self.native.batches)]
        else:
            workers = [self._worker(queue) for _ in range(requests)]
        bucket_workers = len(workers)
        peer_pool: ThreadPoolExecutor | None = None
        if self.peers is not None:
            # Objects a peer ranks before this node for go from the bucket's workers to these;
            # what no peer gives, they fetch from the bucket themselves (fetch.py), so nothing
            # flows back and the two pools cannot wait on each other. Held requests wait on
            # threads, not on the loop.
            n = max(8, min(64, self.opts.concurrency))
            peer_pool = ThreadPoolExecutor(n, thread_name_prefix="peer")
            from . import peer_native

            if pn := peer_native.load(module):
                # The first request for most objects, many at once on native tasks (peer_native.py).
                self.peer_native = peer_native.NativePeers(pn, self.peers, native.threads(available_cpus()))
            # Unbounded: a bucket worker hands an object over without waiting (the listing pauses
            # instead, past PEER_BACKLOG). A bucket worker that waited here could wait on this
            # node's peer threads, held on peers whose bucket workers wait the same way.
            peer_queue: asyncio.Queue[Work] = asyncio.Queue()
            self.peer_queue = peer_queue
            bucket = workers

            async def bucket_then_peers() -> None:
                await _gather_or_cancel([asyncio.create_task(w) for w in bucket])
                for _ in range(n):
                    await peer_queue.put(None)

            if self.peer_native is not None:
                workers = [bucket_then_peers(), self._native_peer_worker(peer_queue, peer_pool, self.peer_native, n)]
            else:
                workers = [bucket_then_peers(), *(self._peer_worker(peer_queue, peer_pool) for _ in range(n))]

        async def feed() -> None:
            await self._produce(known, queue)
            self._check_revision()
            for _ in range(bucket_workers):
                await queue.put(None)

        if self.peers is not None:
            from dscache_contract.peers import claims_path

            self.claims = open(claims_path(rev.c, rev.rev), "a", buffering=1 << 16)  # noqa: SIM115 (closed in finally)
        ticker = asyncio.create_task(self._tick())
        finder = asyncio.create_task(self._find_peers()) if self.peers is not None else None
        try:
            with rev.open_journal() as self.journal:
                with open(self.manifest_tmp, "w", buffering=1 << 16) as self.manifest:
                    await _gather_or_cancel([asyncio.create_task(c) for c in (feed(), *workers)])
                await self._settle_empties(known)
                manifest, summary = self._conclude(resuming)
            if self.claims is not None:
                # Every object is placed: nobody need wait on a claim any more, and tmp/ must be empty to seal.
                with self._claims_lock:
                    self.claims.close()
                os.unlink(self.claims.name)
            rev.seal(manifest, self.tree.dirs, summary)
            return summary
        except Exception as e:
            if (failed := self._failure(e)) is e:
                raise
            raise failed from e
        finally:
            ticker.cancel()
            if self.listing_writer is not None:
                self.listing_writer.abort()  # a no-op once finished
            if finder is not None:
                finder.cancel()
            if self.peers is not None:
                self.peers.close()
            if self.peer_native is not None:
                self.peer_native.close()
                done = self.peer_native
                handed = ", ".join(f"{why} {n}" for why, n in done.handed.most_common())
                self.progress.note(
                    f"native peers: {done.placed} object(s) taken in batches ({done.calls} calls)"
                    + (f"; to the Python path: {handed}" if handed else "")
                )
            if self.claims is not None:
                with self._claims_lock:
                    self.claims.close()
            if peer_pool is not None:
                peer_pool.shutdown(wait=False, cancel_futures=True)
            self.fetcher.close()
            self._close()

    # --- listing ------------------------------------------------------------

    async def _produce(self, known: dict[str, ManifestEntry], queue: asyncio.Queue[Work]) -> None:
        listing = await self._listing()
        try:
            async for batch in listing:
                fetch = self._plan(batch, known)
                for item in fetch:
                    while self.peer_queue is not None and self.peer_queue.qsize() >= PEER_BACKLOG:
                        await asyncio.sleep(0.05)
                    await queue.put(item)
        except UnrepresentableKeys as e:
            # obstore refused a key; list verbatim with boto3 to name them all.
            keys = await asyncio.to_thread(list_keys_raw, self.source)
            raise self._unrepresentable(e, keys) from e
        self.progress.listing_done = True

    async def _listing(self) -> AsyncIterator[list[RemoteObject]]:
        """Where the listing comes from: a peer's or this node's earlier one, checked against the
        revision (peer_listing.py), or the bucket; a node that lists the bucket with peers keeps
        what it lists for them, listing ahead of its own copy (``listing_writer``)."""
        if self.peers is not None and self.started_listing is None:
            from . import peer_listing  # with peers only: http.client and the peers' modules

            await self.peers_known.wait()
            if self.opts.cohort and not self.peers.others():
                # Pods of a gang start together and may each see only themselves at first; a lone
                # pod (no --cohort) lists at once. The finder asks the agent again meanwhile.
                self.progress.note(
                    f"listing: no other node stages revision {self.rev.rev} yet; looking again in "
                    f"{peer_listing.SETTLE_S} s before listing the bucket (--cohort: pods on other nodes start too)"
                )
                await asyncio.sleep(peer_listing.SETTLE_S)
            got = await asyncio.to_thread(peer_listing.from_peers, self.peers, self.rev, self.progress.note)
            if got is not None:
                return peer_listing.read(got)
            # Listed ahead of this node's copy, for the peers waiting for the whole of it.
            self.listing_writer = peer_listing.ListingWriter(self.rev)
            return peer_listing.ahead(
                self._bucket_listing(), self.listing_writer, self.rev.rev, self.selection.relative
            )
        return self._bucket_listing()

    def _bucket_listing(self) -> AsyncIterator[list[RemoteObject]]:
        if self.opts.as_of:
            return list_versions(self.source, self.opts.as_of)
        return list_objects(self.store, self.source.prefix, self.started_listing)

    def _python_store(self) -> S3Store:
        """obstore's client for fetch.py (peers' turns, the fallback): the run's own when it is
        obstore's, else one opened now, the first time fetch.py makes a request (store.py)."""
        if isinstance(self.store, NativeStore):
            return self.source.open_store(self.opts.concurrency)
        return self.store

    async def _settle_empties(self, known: dict[str, ManifestEntry]) -> None:
        """Empty objects: a real empty file, or a directory marker ``a/`` that obstore shows as ``a``.

        A marker with objects under it is recognised from the listing alone.
        Only an empty object with nothing under it is ambiguous; its HEAD runs
        under the same request limit as every GET, on the pooled keep-alive
        connections, so 3,000 empty files cost 3,000 small requests on at most
        --concurrency connections. Creating an empty file opens no connection.
        """

        async def settle(obj: RemoteObject, rel: str, above: str | None) -> None:
            present = self._listed_presence(obj, rel)
            if present is None:
                async with self.requests:
                    present = await exists(self.store, obj.key)
            self._settle_empty(obj, rel, above, known, present)

        await _gather_or_cancel([asyncio.create_task(settle(*e)) for e in self.empties])

    # --- copying ------------------------------------------------------------

    async def _worker(self, queue: asyncio.Queue[Work]) -> None:
        fetcher = self.fetcher
        while (item := await queue.get()) is not None:
            if self.peers is not None:
                if await self._to_peers(item):
                    continue
                self._claim([item])
            obj, rel, _ = item
            got = await fetcher.fetch(obj.key, rel, obj.size, obj.etag, obj.version_id)
            self._record(obj, rel, got)

    async def _native_worker(self, queue: asyncio.Queue[Work]) -> None:
        """A batch at a time: small objects to the native copier, the others to fetch.py. While
        other nodes share the revision (or may still come), paced (peers_pace.py): one worker at a
        time takes a batch of what the window has room for, decides which objects are its own
        and claims them, then fetches them outside the lock."""
        assert self.native is not None
        nat = self.native
        while True:
            pace = self.pace if self._pacing() else None
            if pace is None:
                batch, end = await _take(queue, nat.batch_size)
                jobs, claimed = await self._decide(batch)
                nbytes = 0
            else:
                async with pace.lock:
                    await pace.room()
                    batch, end = await _take(queue, nat.batch_size, pace.room_left())
                    jobs, claimed = await self._decide(batch)
                    nbytes = sum(obj.size for obj, _, _ in claimed)
                    pace.take(nbytes)
            try:
                if len(jobs) > 1:
                    await _gather_or_cancel([asyncio.create_task(j) for j in jobs])
                elif jobs:
                    await jobs[0]  # the usual batch: no task nor gather of its own
            finally:
                if pace is not None:
                    await pace.give(nbytes)
            if end:
                return

    def _pacing(self) -> bool:
        """Whether bucket reads are paced: with peers on, while other nodes copy or hold the
        revision, or may still come (the cohort window and a second)."""
        if self.peers is None:
            return False
        from dscache_contract.peers import COHORT_WINDOW_S

        return bool(self.peers.others()) or time.monotonic() < self.started + COHORT_WINDOW_S + 1.0

    async def _decide(self, batch: list[Task]) -> tuple[list[Coroutine[Any, Any, None]], list[Task]]:
        """Which of ``batch`` go to the peers (handed over), and the fetches of the others from the
        bucket, claimed: (the coroutines to run, the objects claimed)."""
        assert self.native is not None
        tree = self.tree
        small: list[Task] = []
        jobs: list[Coroutine[Any, Any, None]] = []
        claimed: list[Task] = []
        for task in batch:
            if self.peers is not None and await self._to_peers(task):
                continue
            obj, rel, _ = task
            if not native.handles(obj.size):
                # Large objects go down one at a time, in ranged parts (native.py).
                tree.ensure_parent(rel)
                jobs.append(self._fetch_native_large(obj, rel))
                claimed.append(task)
                continue
            small.append(task)
        claimed += small
        if self.peers is not None:
            self._claim(claimed)
        if small:
            jobs.append(self._fetch_native(small, self._native_items(small)))
        return jobs, claimed

    async def _fetch_native(self, small: list[Task], items: list[native.Item]) -> None:
        assert self.native is not None
        mark("batch-go", len(items))
        grow = [self._grow(obj, rel) for obj, rel, _ in small]
        placed, failure = await self.native.fetch(items, grow if any(grow) else None)
        mark("batch-done", len(placed))
        self._record_native(small, placed)
        if failure is not None:
            raise failure

    def _grow(self, obj: RemoteObject, rel: str) -> str:
        """The file ``obj``'s body grows in as it comes from the bucket, for this node's agent to
        pass on meanwhile: for an object of GROW_MIN bytes or more while other nodes share the
        revision (dscache_contract.peers.GROW_MIN); else "" (written whole, then passed on)."""
        if self.native is None or self.peers is None or not self.peers.grows(obj.size) or not self._pacing():
            return ""
        from dscache_contract.peers import grow_name

        return os.path.join(self.native.tmp_dir, grow_name(rel))

    async def _fetch_native_large(self, obj: RemoteObject, rel: str) -> None:
        assert self.native is not None
        item = (obj.key, self.tree.path(rel), obj.etag, obj.version_id, obj.size)
        got = await self.native.fetch_large(item, self.progress.add_bytes, self._grow(obj, rel))
        self._record(obj, rel, got)

    async def _fetch_one(self, obj: RemoteObject, rel: str) -> None:
        got = await self.fetcher.fetch(obj.key, rel, obj.size, obj.etag, obj.version_id)
        self._record(obj, rel, got)

    # --- fetch once per cluster ----------------------------------------------

    async def _find_peers(self) -> None:
        """Ask the agent who the peers are: at once (the answer comes while the first listing page
        does, so a lone node waits for nobody), then every second. A node that starts later sees
        this one at once; this one sees it within a second, and meanwhile the later one looks at
        this one's claims before it reads the bucket (peers.early_peers)."""
        from dscache_contract.peers import COHORT_WINDOW_S

        from .peers import EARLY_REFRESH_S, REFRESH_S

        assert self.peers is not None
        peers = self.peers
        answer = await asyncio.to_thread(peers.ask_agent)
        self.peers_known.set()
        early_until = time.monotonic() + COHORT_WINDOW_S + 1.0
        others = peers.others()
        self.progress.note(
            f"peers: {len(others)} other node(s) hold or copy revision {self.rev.rev}"
            + (f" ({', '.join(others[:8])})" if others else "; this node reads the bucket")
            if answer is not None
            else "peers: the node agent did not answer; every object comes from the bucket"
        )
        while True:
            # Often while the nodes that start together find each other: a node that took an object
            # before it knew of the one it is ranked to makes that one wait for it.
            await asyncio.sleep(EARLY_REFRESH_S if time.monotonic() < early_until else REFRESH_S)
            await asyncio.to_thread(peers.ask_agent)

    def _claim(self, items: list[Task]) -> None:
        """Say, before the GETs, which objects this node reads from the bucket: a peer that asks
        for one of them waits for this node's copy instead of reading the bucket too (one write)."""
        if items:
            self._claim_lines("".join(f"{rel}\n" for _, rel, _ in items))

    def _claim_lines(self, text: str) -> None:
        """Append to the claims (the loop, and the peer threads: a relay claim, peers.obtain)."""
        if self.claims is not None:
            with self._claims_lock:
                if not self.claims.closed:
                    self.claims.write(text)
                    self.claims.flush()

    def _relay_claim(self, line: str) -> None:
        self._claim_lines(line + "\n")

    async def _to_peers(self, item: Task) -> bool:
        """Hand ``item`` to the peer workers if a node ranks before this one for it, or an earlier
        one may read it (decided when a worker takes it, not when it was listed: the peers known
        then are the freshest). Never waits but for the first answer of the agent."""
        assert self.peers is not None and self.peer_queue is not None
        await self.peers_known.wait()
        obj = item[0]
        if self.peers.verifiable(obj.etag, obj.size) and self.peers.to_peers(obj.key):
            self.peer_queue.put_nowait(item)
            return True
        return False

    async def _peer_worker(self, peer_queue: asyncio.Queue[Work], pool: ThreadPoolExecutor) -> None:
        assert self.peers is not None
        peers, loop = self.peers, asyncio.get_running_loop()
        while (item := await peer_queue.get()) is not None:
            obj, rel, _ = item
            self.tree.ensure_parent(rel)  # on the loop: LocalTree is not shared with threads
            got = await loop.run_in_executor(
                pool, peers.obtain, obj.key, rel, obj.size, obj.etag, self._peer_tmp, self._relay_claim
            )
            await self._peer_got(item, got, pool)

    async def _native_peer_worker(
        self, peer_queue: asyncio.Queue[Work], pool: ThreadPoolExecutor, pn: NativePeers, in_flight: int
    ) -> None:
        """The peer workers' part on the native plane: at most ``in_flight`` objects at once, as
        many peer threads as peers.py would run. Whatever is queued when objects end (up to
        peer_native.BATCH) is asked of each one's first choice in one native call per peer; each
        object then ends on its own (placed, or peers.obtain for the rest), never waiting for the
        others of its batch. (Batches of 32 per worker, 64 workers, waiting for their slowest
        object, had 2,048 objects in flight far ahead of the listing, held by their parents, and
        ran 4x slower than the threads: bench/fanout.py small files, issue 30.)

        An "unclaimed" answer is followed here as peers.obtain follows it, on the native plane too:
        the parent's parent at once, or, from the root, the object's chain again after obtain's
        pause (ROOT_PAUSE_S doubling up to ROOT_PAUSE_MAX_S); those objects of a batch go on
        together. (Each went to obtain: a thread, http.client, a Python hash and write per
        request; a sixth of the first requests were answered so, 20,000 x 16 KiB on 4 nodes.)
        A root that has not come to an object within peers.PATIENCE_S hands it to obtain, whose
        patience then writes that root off: a live root that never reads it cannot hold the
        object, and the run, for ever.
        A held request answered "still copying" is followed here too, as obtain follows it: the
        chain ranked afresh and asked again at once, each peer's patience for the object kept
        (PATIENCE_S in all; past it, obtain, seeded with it, writes the peer off), a hop below the
        root that held without sending passed over while a complete copy is up the chain. (Each
        went to obtain: a Python GET read a few kB per call through the shaped links, the heaviest
        Python of a stager at 16 nodes.) The native calls run on the loop (NativePeers.ask): no
        thread of the pool waits on one (a thread start and two hops per call, hundreds per node).
        An object that is this node's own to read by now goes to the native copier, in a batch
        with the others (``_bucket_native``), not through obtain and fetch.py."""
        from .peer_native import BATCH
        from .peers import PATIENCE_S, RERANK_S, ROOT_PAUSE_MAX_S, ROOT_PAUSE_S, Outcome

        assert self.peers is not None
        peers, loop = self.peers, asyncio.get_running_loop()
        room = asyncio.Semaphore(in_flight)
        tasks: set[asyncio.Task[None]] = set()
        failed: list[BaseException] = []
        me = asyncio.current_task()

        def ended(t: asyncio.Task[None]) -> None:
            tasks.discard(t)
            if not t.cancelled() and (e := t.exception()) is not None and not failed:
                failed.append(e)
                if me is not None:
                    me.cancel()  # the run fails now, not when the queue ends

        def spawn(coro: Coroutine[Any, Any, None]) -> None:
            t = asyncio.create_task(coro)
            tasks.add(t)
            t.add_done_callback(ended)

        async def one(
            item: Task,
            got: Obtained | None,
            patience: dict[str, float] | None = None,
            held: frozenset[str] = frozenset(),
        ) -> None:
            try:
                if got is None:
                    obj, rel, _ = item
                    got = await loop.run_in_executor(
                        pool,
                        peers.obtain,
                        obj.key,
                        rel,
                        obj.size,
                        obj.etag,
                        self._peer_tmp,
                        self._relay_claim,
                        patience,
                        held,
                    )
                await self._peer_got(item, got, pool)
            finally:
                room.release()

        async def bucket(item: Task) -> None:
            # This node's own by now (no peer ranks before it, the early peers answered).
            try:
                self._claim([item])
                await self._bucket_native(item)
            finally:
                room.release()

        # Per root, the first key (listing order) it said it has not come to yet, and when (last
        # said). A root claims what it reads in listing order: it had not come to any later key
        # either. An object asked again after a pause whose root is behind it (fresh) waits one
        # more pause without a request: only the first such key per root is asked each round,
        # not every object waiting on it (two requests each: parent and root, every round, were
        # an "unclaimed" answer per object served at 16 nodes, issue 30). Its answer moves or
        # drops the mark; an unrefreshed mark expires after BEHIND_S.
        behind: dict[str, tuple[str, float]] = {}
        # The same for a hop below the root (a parent): it takes objects in listing order too (it
        # claims the relay when it first asks), so it has not come to later keys either: those
        # are asked of the next hop up at once, as after its "unclaimed". (The first request of
        # an object whose parent started after this node was an "unclaimed" almost every time.)
        # A root's mark holds for it as a parent as well (it relays no further than it claims).
        behind_hop: dict[str, tuple[str, float]] = {}

        def passed(marks: list[dict[str, tuple[str, float]]], addr: str, key: str, now: float) -> bool:
            """Whether ``addr`` said, within BEHIND_S, that it has not come to a key before ``key``."""
            return any((mark := m.get(addr)) is not None and key > mark[0] and now - mark[1] < BEHIND_S for m in marks)

        def dispatch(asks: list[_Ask], claimed: bool) -> None:
            """Each object to the peer its chain names now (``hop``), in one native call per peer;
            the rest to the native copier (this node's turn) or to peers.obtain. ``claimed``: asked
            before (relay claimed): one behind its root's mark waits a pause more instead."""
            groups: dict[str, list[_Ask]] = {}
            wait_more: dict[float, list[_Ask]] = {}
            now = time.monotonic()
            for ask in asks:
                obj = ask[0][0]
                chain = pn.route(obj.key, obj.etag, obj.size, ask[5])  # []: not on the native plane
                if chain and (behind_hop or behind):
                    # Parents that have not come to an earlier key: the next hop up at once.
                    hop, last = ask[1], len(chain) - 1
                    while hop < last and passed([behind_hop, behind], chain[hop], obj.key, now):
                        hop += 1
                    if hop != ask[1]:
                        ask = (ask[0], hop, *ask[2:])
                    # Asked before, its root behind: a pause more (its first request claims the relay).
                    if claimed and hop >= last and passed([behind], chain[-1], obj.key, now):
                        pause = ask[2]
                        wait_more.setdefault(pause, []).append((ask[0], 0, min(pause * 2, ROOT_PAUSE_MAX_S), *ask[3:]))
                        continue
                if chain:
                    groups.setdefault(chain[min(ask[1], len(chain) - 1)], []).append(ask)
                elif self.native is not None and native.handles(obj.size) and not peers.to_peers(obj.key):
                    spawn(bucket(ask[0]))
                else:
                    # Not native (multipart, large), or this node's own with earlier peers to probe.
                    pn.handed["no native hop"] += 1
                    spawn(one(ask[0], None, ask[4], ask[5]))
            for addr, group in groups.items():
                for i in range(0, len(group), BATCH):
                    spawn(first(addr, group[i : i + BATCH], claimed))
            for pause, parked in wait_more.items():
                spawn(again(pause, parked))

        async def first(addr: str, group: list[_Ask], claimed: bool) -> None:
            wants = [(obj.key, rel, obj.size, obj.etag) for (obj, rel, _), *_ in group]
            claim = None if claimed else self._relay_claim
            owned = len(group)  # room this call holds: released, or handed on with its object
            asked_at = time.monotonic()
            # A held request lasts RERANK_S, or what is left of the peer's patience for the object.
            waits = (
                [
                    min(RERANK_S, max(0.0, p[addr] - asked_at)) if p and addr in p else RERANK_S
                    for _, _, _, _, p, _ in group
                ]
                if any(a[4] for a in group)
                else None
            )
            try:
                trace.mark("peer-go", len(wants))
                early: set[int] = set()

                def placed(i: int, tmp: str) -> None:
                    # Into place as soon as it is here, not when the call's slowest object is
                    # (its children may be asking this node for it): on the loop, from the reader.
                    nonlocal owned
                    if trace.ON:
                        trace.mark(f"obj placed {addr} {group[i][0][1]} h{group[i][1]}", trace.ms_since(asked_at))
                    self._peer_placed(group[i][0], tmp)
                    early.add(i)
                    owned -= 1
                    room.release()

                gots = await pn.ask(addr, wants, self._peer_tmp, claim, waits, placed)
                if trace.ON:
                    trace.mark("peer-placed", len(early))
                    unclaimed = sum(1 for g in gots if g is not None and g.outcome is Outcome.UNCLAIMED)
                    trace.mark("peer-unclaimed", unclaimed)
                    trace.mark("peer-ms", trace.ms_since(asked_at))
                nxt: list[_Ask] = []
                later: dict[float, list[_Ask]] = {}
                for i, ((item, hop, pause, since, patience, slow), got) in enumerate(zip(group, gots, strict=True)):
                    if got is None or got.outcome is not Outcome.UNCLAIMED:
                        for marks in (behind, behind_hop):
                            if (mark := marks.get(addr)) is not None and item[0].key >= mark[0]:
                                del marks[addr]  # it has come to the mark's key: the others are asked again
                    if i in early:
                        continue  # placed as it came (placed() above: every object placed goes there)
                    if trace.ON:
                        said = "handed" if got is None else got.outcome.value
                        trace.mark(f"obj {said} {addr} {item[1]} h{hop}", trace.ms_since(asked_at))
                    if got is not None and got.outcome is Outcome.UNCLAIMED:
                        last = hop + 1 >= pn.hops(item[0].key, slow)
                        marks = behind if last else behind_hop
                        key, mark = item[0].key, marks.get(addr)
                        if mark is None or key <= mark[0] or time.monotonic() - mark[1] >= BEHIND_S:
                            marks[addr] = (key, time.monotonic())
                        if not last:
                            # a parent not there yet: its parent
                            nxt.append((item, hop + 1, pause, since, patience, slow))
                        elif time.monotonic() - since >= PATIENCE_S:
                            owned -= 1
                            pn.handed["unclaimed past patience"] += 1
                            spawn(one(item, None, patience, slow))  # the root's patience is up: obtain's policy
                        else:
                            # The root has not come to it yet: ask again in a moment (not the
                            # bucket: that would read it twice).
                            again_ask = (item, 0, min(pause * 2, ROOT_PAUSE_MAX_S), since, patience, slow)
                            later.setdefault(pause, []).append(again_ask)
                    elif got is not None and got.outcome is Outcome.WAIT:
                        # Still copying it after the held request: as obtain, rank again and ask at
                        # once, within this peer's patience for the object.
                        patience = dict(patience or {})
                        deadline = patience.setdefault(addr, asked_at + PATIENCE_S)
                        if hop + 1 < pn.hops(item[0].key, slow):
                            slow = slow | {addr}  # below the root: passed over for a complete copy
                        if time.monotonic() >= deadline:
                            owned -= 1
                            pn.handed["copying past patience"] += 1
                            spawn(one(item, None, patience, slow))  # obtain writes the peer off
                        else:
                            nxt.append((item, 0, pause, since, patience, slow))
                    else:
                        owned -= 1
                        spawn(one(item, got))
                owned = 0  # every one below is handed on
                if nxt:
                    dispatch(nxt, True)
                for pause, asks in later.items():
                    spawn(again(pause, asks))
            except BaseException:
                for _ in range(owned):
                    room.release()
                raise

        async def again(pause: float, asks: list[_Ask]) -> None:
            try:
                # jitter: the nodes do not all ask again at once
                await asyncio.sleep(pause * (0.5 + random.random()))
            except BaseException:
                for _ in asks:
                    room.release()
                raise
            dispatch(asks, True)

        try:
            end = False
            while not end:
                await room.acquire()
                item = await peer_queue.get()
                if item is None:
                    room.release()
                    break
                batch = [item]
                waited = False
                while len(batch) < BATCH:
                    if room.locked():
                        if waited or peer_queue.empty():
                            break
                        # All in flight, more queued: let a few more end first, and ask for them
                        # in one call. (Room freed one object at a time made a call per object:
                        # 15,000 objects in 10,000 calls per node, a thread hop each.)
                        waited = True
                        await asyncio.sleep(PEER_GATHER_S)
                        continue
                    try:
                        more = peer_queue.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                    if more is None:
                        end = True
                        break
                    await room.acquire()  # free: not locked
                    batch.append(more)
                for item in batch:
                    self.tree.ensure_parent(item[1])  # on the loop: LocalTree is not shared with threads
                now = time.monotonic()
                dispatch([(item, 0, ROOT_PAUSE_S, now, None, frozenset()) for item in batch], False)
            while tasks:
                await asyncio.wait(set(tasks))
        except asyncio.CancelledError:
            if not failed:
                raise
        finally:
            for t in list(tasks):
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        if failed:
            raise failed[0]

    async def _bucket_native(self, item: Task) -> None:
        """Read ``item`` from the bucket on the native copier, in one batch with the others that
        come within BUCKET_GATHER_S (objects no peer gave: fetch.py's obstore GET and Python write,
        on a thread hop each, cost more than a peer's transfer, issue 30)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._to_bucket.append((item, fut))
        if len(self._to_bucket) == 1:
            loop.call_later(BUCKET_GATHER_S, self._flush_bucket)
        await fut

    def _flush_bucket(self) -> None:
        assert self.native is not None
        pending, self._to_bucket = self._to_bucket, []
        size = self.native.batch_size
        for i in range(0, len(pending), size):
            t = asyncio.ensure_future(self._bucket_batch(pending[i : i + size]))
            self._bucket_batches.add(t)
            t.add_done_callback(self._bucket_batches.discard)

    async def _bucket_batch(self, chunk: list[tuple[Task, asyncio.Future[None]]]) -> None:
        small = [task for task, _ in chunk]
        try:
            await self._fetch_native(small, self._native_items(small))
        except asyncio.CancelledError:
            for _, f in chunk:
                f.cancel()
            raise
        except BaseException as e:
            for _, f in chunk:
                if not f.done():
                    f.set_exception(e)  # each waiting object's task fails: the run does
            return
        for _, f in chunk:
            if not f.done():
                f.set_result(None)

    async def _peer_got(self, item: Task, got: Obtained, pool: ThreadPoolExecutor) -> None:
        """Place what a peer sent, or read the bucket (and judge a suspect peer's body by its copy)."""
        from .peers import Outcome

        assert self.peers is not None
        peers, loop = self.peers, asyncio.get_running_loop()
        obj, rel, _ = item
        if got.outcome is Outcome.PLACED:
            self._peer_placed(item, got.tmp)
            return
        self._claim([item])
        if self.native is not None and native.handles(obj.size):
            await self._bucket_native(item)  # this node's turn: the bucket, in a native batch
        else:
            await self._fetch_one(obj, rel)  # this node's turn: the bucket
        if got.suspect is not None:
            # A body that did not hash to the ETag: the bucket's copy says whether the peer lied.
            await loop.run_in_executor(pool, peers.judge, *got.suspect, obj.etag, self.tree.path(rel))

    def _peer_placed(self, item: Task, tmp: str) -> None:
        """A peer's verified body in ``tmp``: into place, journalled, counted (on the loop)."""
        obj, rel, line = item
        self.tree.place(tmp, rel)
        self.journal.write(line)
        self.fetched_bytes += obj.size
        self.peer_bytes += obj.size
        self.progress.peer_bytes += obj.size
        self.progress.fetched_objects += 1
        self.progress.add_bytes(obj.size)

    def _peer_tmp(self) -> str:
        """A fresh temp file name for a peer's body (called from the peer threads)."""
        with self._peer_seq_lock:
            self._peer_seq += 1
            return os.path.join(self.rev.tmp, f"peer-{self._peer_seq}")

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.opts.progress_interval)
            if not self.journal.closed:
                self.journal.flush()  # a killed run loses at most one interval of records
            self.progress.report()


async def _take(queue: asyncio.Queue[Work], most: int, room: int | None = None) -> tuple[list[Task], bool]:
    """Up to ``most`` queued items without waiting for more than the first (``room``: and no more
    once their bytes reach it); and whether the end was reached."""
    batch: list[Task] = []
    item = await queue.get()
    nbytes = 0
    while item is not None:
        batch.append(item)
        nbytes += item[0].size
        if len(batch) >= most or (room is not None and nbytes >= room):
            return batch, False
        try:
            item = queue.get_nowait()
        except asyncio.QueueEmpty:
            return batch, False
    return batch, True


async def _gather_or_cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Wait for all tasks; on the first failure cancel the rest and re-raise it."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

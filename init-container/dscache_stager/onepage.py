"""The cold copy of a one-page revision, without asyncio (issue 30).

When the access proof's first listing page was the whole listing (listpage.Started with no
rest), no peers take part, the revision is not pinned by version (--as-of) and the native
plane is loaded, there is nothing to overlap: the listing is in hand, and the native copier
bounds its own requests, buffers and ranged parts. So the copy runs on this thread: the page
planned (copyrun.CopyRun: hash, hostile keys, space), the revision checked before any byte is
fetched, the large objects handed to the copier on the pool's threads (one blocking
fetch_large each, in ranged parts) and the small ones in batches on this thread meanwhile, the
empty objects settled by HEAD, sealed. Everything but this orchestration is sync._Run's, shared.

Large objects came here too in issue 30's large35 round: on sync.py, a revision of a few
large shards paid for asyncio's imports (and sync.py's, fetch.py's, ssl's) between its
listing and its first ranged GET, ~50-90 ms of a 0.3 s copy of 2 x 256 MiB (strace -f -ttt:
listing answered at 0.18 s, first part's connect at 0.29 s under load ~30), all of it on the
critical path. See native.py for the figures.

Why: asyncio, with ssl, selectors, subprocess and their shared objects (~35 modules), cost a
cold start ~40 ms of ~135 after a page-cache drop (~15 ms cached) on a copy of one small object.
DSCACHE_ONEPAGE=0 turns this path off (sync.py copies every revision; the tests compare both).

Measured (bench/stager.py --quick --profiles=loopback --sets fixed --peers s5cmd --workers=
--runs 7, the shipped layout; main d25d60b and this path in turns, medians of 7): at load 6-10,
main 0.216/0.132 s wall after the drop, this path 0.162/0.099 (s5cmd 0.030-0.040); CPU
0.098/0.091 -> 0.079/0.072 s; page cache kept 0.093/0.090 -> 0.073/0.065 s (CPU 0.077/0.075
-> 0.062/0.061); read after the drop 19.5 -> 17.5 MiB. The Python plane (sync.py either way) in
the same runs: 0.100/0.094 and 0.099/0.099 s CPU. At load 17-54 (three pairs) CPU 0.098-0.120
-> 0.081-0.093 s; wall there is noise.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import TYPE_CHECKING

from dscache_contract import ManifestEntry, StageSummary

from . import native
from .copyrun import CopyRun, Task
from .cpus import available_cpus
from .objects import Fetched, remote_objects
from .store import head
from .switches import env_flag

if TYPE_CHECKING:
    from .layout import Revision
    from .listpage import Started
    from .progress import Progress
    from .store import AnyStore
    from .sync_options import SyncOptions

#: "0": every cold copy runs on asyncio (sync.py), as before this path existed.
ENV = "DSCACHE_ONEPAGE"


def fits(opts: SyncOptions, listing: Started | None) -> bool:
    """Whether this path copies the revision (stage.py asks once the access proof listed)."""
    if not env_flag(ENV, True):
        return False
    if listing is None or listing.rest is not None or opts.as_of is not None:
        return False
    if opts.agent and opts.cache and opts.peer_token_file:
        return False  # peers: sync.py (the listing and objects may come from other nodes)
    return native.load() is not None  # large objects too: NativeFetcher.fetch_large_blocking


def cold(opts: SyncOptions, rev: Revision, store: AnyStore, progress: Progress, listing: Started) -> StageSummary:
    """Stage ``rev`` from the one page ``listing`` holds (called by stage.sync with C's lock held)."""
    return OnePage(opts, rev, store, progress, listing).run()


class OnePage(CopyRun):
    """sync._Run's copy for a revision of one listing page, on this thread."""

    control_thread = "main thread"

    def run(self) -> StageSummary:
        rev, listing = self.rev, self.started_listing
        assert listing is not None and listing.rest is None
        resuming, known = self._open()
        module = native.load()
        assert module is not None  # fits() saw it load
        self.native = nat = native.NativeFetcher(
            module, self.source, self.opts.concurrency, native.threads(available_cpus()), rev.tmp
        )
        self.progress.note(f"native data plane: {nat.workers} threads, one listing page on this thread")
        try:
            with rev.open_journal() as self.journal:
                with open(self.manifest_tmp, "w", buffering=1 << 16) as self.manifest:
                    fetch = self._plan(remote_objects(listing.first), known)
                    self.progress.listing_done = True
                    # The whole listing is in hand: check it before a byte is fetched.
                    self._check_revision()
                    if not self.hostile:
                        self._copy(fetch)
                self._settle_empties(known)
                manifest, summary = self._conclude(resuming)
            rev.seal(manifest, self.tree.dirs, summary)
            return summary
        except Exception as e:
            if (failed := self._failure(e)) is e:
                raise
            raise failed from e
        finally:
            self._close()

    def _copy(self, fetch: list[Task]) -> None:
        """Every object to the copier: the large ones first, each on a thread of the native pool
        (as sync.py runs them; the copier bounds their parts in flight), then the small ones on
        this thread in chunks of twice --concurrency (what sync.py keeps in flight) while the
        large ones' parts arrive; then the large ones recorded as they end. The progress is
        reported and the journal flushed at --progress-interval, as sync._Run's ticker does."""
        nat = self.native
        assert nat is not None
        large = [t for t in fetch if not native.handles(t[0].size)]
        small = [t for t in fetch if native.handles(t[0].size)]
        jobs: list[Future[Fetched]] = []
        for obj, rel, _ in large:
            self.tree.ensure_parent(rel)
            item = (obj.key, self.tree.path(rel), obj.etag, obj.version_id, obj.size)
            jobs.append(nat.pool.submit(nat.fetch_large_blocking, item))
        self.last_tick: float = time.monotonic()
        step = max(nat.batch_size, 2 * self.opts.concurrency)
        for start in range(0, len(small), step):
            chunk = small[start : start + step]
            placed, failure = nat.fetch_blocking(self._native_items(chunk))
            self._record_native(chunk, placed)
            if failure is not None:
                raise failure
            self._tick()
        # Recorded as each ends; the first failure raised at once (the rest are then cancelled
        # by _close), after the objects placed with it are journalled.
        pending = dict(zip(jobs, large, strict=True))
        while pending:
            done, _ = wait(pending, timeout=self._tick(), return_when=FIRST_EXCEPTION)
            for job in sorted(done, key=lambda j: j.exception() is not None):
                obj, rel, _ = pending.pop(job)
                self._record(obj, rel, job.result())
        if large:
            nat.report_large(self.progress.add_bytes)

    def _tick(self) -> float:
        """At --progress-interval: the large parts' bytes counted, the journal flushed (a killed
        run loses at most one interval of records), the progress reported. Seconds to the next
        tick (at least 10 ms: how long a wait on a large object may block)."""
        assert self.native is not None
        now = time.monotonic()
        if now - self.last_tick >= self.opts.progress_interval:
            self.last_tick = now
            self.native.report_large(self.progress.add_bytes)
            self.journal.flush()
            self.progress.report()
        return max(0.01, self.last_tick + self.opts.progress_interval - now)

    def _settle_empties(self, known: dict[str, ManifestEntry]) -> None:
        """sync._Run._settle_empties one at a time: a one-page revision holds few empty objects."""
        for obj, rel, above in self.empties:
            present = self._listed_presence(obj, rel)
            if present is None:
                present = head(self.store, obj.key)
            self._settle_empty(obj, rel, above, known, present)

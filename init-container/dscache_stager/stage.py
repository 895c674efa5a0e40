"""``dscache-stage sync``: stage one pinned revision of an S3 prefix into C/revs/<rev>.

1. Access proof, always: one cheap request with this pod's own credentials, so
   a pod that may not read the bucket never gets the data, even when another
   pod staged it (exit 3):
   - warm: a HEAD of the revision's first object: s3:GetObject on it;
   - cold: one ListObjectsV2 page under the prefix: s3:ListBucket on the prefix.
     Without peers it is the listing's first page, which the copy goes on from;
     with peers (or --as-of, listed by versions anyway) it is an empty page
     (listpage.empty_page: a few hundred bytes), since the listing may come
     from a peer (peer_listing.py), checked against the revision.
   Neither proves the other permission; a cold run reads its own objects from
   the bucket with these credentials, but objects a peer sends are not each
   proven readable by this pod (the revision's bytes are checked, not its access).
2. Under C's lock: write this pod's lease, then
   - warm: the revision is complete on the node; done, without listing;
   - cold (sync.py): list, hash, GET with If-Match, seal; a listing that is
     not the revision any more fails with exit 9 and leaves nothing behind.
     A revision whose whole listing was the access proof's page, without peers
     or --as-of, is copied the same way without asyncio, its large objects in
     ranged parts too (onepage.py, chosen by onepage.fits once the page is in).

No asyncio on this path: the warm start is a process start, one HEAD, a lock
and a small file write, and importing asyncio (with ssl) alone would cost
more than the rest.

A cold start's fixed cost (issue 30; bench/stager.py --sets fixed: one 1 KiB
object, the page cache dropped before each run), before -> after this round,
7 runs each back to back at load 2.9 on 2 cores: 0.304 -> 0.134 s wall (s5cmd
0.041, 0.031), 0.149 -> 0.091 s CPU; with the page cache kept 0.113 -> 0.075 s
wall, 0.108 -> 0.072 s CPU (s5cmd 0.012-0.016). Where a traced cold run's wall
went (ms, cache dropped / kept, load 2.6, before in brackets): interpreter and
site 31/17 (32/17), cli's imports (contract, obstore) 45/21 (64/33), parse and
checks 7/5 (9/6), the S3 client 1/1 (15/4), the endpoint check 0.6/0.6 (5/2),
first listing page 2/2, lock and lease 1/2, waiting for the cold path's
imports (asyncio, sync, the native plane, on a thread since the start) 29/16
(24/16), the copy (Copier, GET, seal) 10/5 (13/7), exit 3/3: 131/73 (174/95).
Nothing waits on a sleep, a poll or an fsync (none is made). After the drop
the process reads ~30 MiB (fixed_read_mib): libpython (10 MiB of this venv's
build), obstore's extension (15), dscache_native (5.6), libcrypto (4.7);
s5cmd reads its one 17.5 MiB binary.

Cut this round: the S3 clients' TLS roots on plain HTTP from one bundle file
(source.roots_from_one_file: each client read every file of /etc/ssl/certs);
the contract imported lazily, module by module; no shutil (argparse imported it
for the help's width: zlib, bz2, lzma, ~7 ms), no idna codec (unicodedata, ~6
ms) and no peers' modules (http.client, email) without peers; no garbage
collection during start-up (46 runs, ~4 ms). Measured without effect again:
reading the big shared objects ahead (posix_fadvise WILLNEED at package import,
14 interleaved drops: median 325 against 340 ms, within the noise) and starting
the import thread at the package's import instead of here (14 interleaved runs
at load 2.5: 147 against 148 ms with the drop, 147 against 136 without: its
imports contend with cli's for the GIL). What is left is what the design imports: the interpreter (~7 ms
bare), asyncio with ssl and concurrent.futures (~30), dataclasses (~12 with
inspect), obstore's extension (~11), argparse, json, typing, socket. For one
object the native plane costs no more CPU than the Python one but 5 MiB more
to read (dscache_python in the same runs: 26.0 MiB). Below 0.1 s with the page
cache dropped, a one-page revision needs a path without asyncio and without one
of the two S3 clients (and their shared objects), or the cold start out of Python.

Next round: one S3 client on the common path (store.py). With the native module and static
keys, the access proof, the listing and the HEADs of empty objects go through dscache_native's
Store (native/src/list.rs, object_store as before), and obstore is imported only by the fallback
and fetch.py's path (peers' turns, no native module, other credentials). The fixed set, base
(main) and this branch in turns, 5 runs each, twice, at load 8-16 on 2 cores: read after the
drop 30.4/30.8 -> 19.6/19.6 MiB (s5cmd 17.7); wall 0.130/0.136 -> 0.118/0.114 s (s5cmd
0.030-0.033); CPU 0.086/0.092 -> 0.088/0.086 s; with the page cache kept 0.077/0.084 ->
0.082/0.072 s (noise). A warm start (the revision on the node: one HEAD) got no slower, 9 runs
each interleaved at load 20-24: 0.099 -> 0.080 s after a drop, 0.049 -> 0.050 s cached, CPU
0.062 -> 0.059 and 0.047 -> 0.046 s. What is left to read is libpython (22 MiB mapped),
dscache_native (5.5), libcrypto (4.5: hashlib's and ssl's, which asyncio imports).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import TYPE_CHECKING

import dscache_contract as contract
from dscache_contract import StageSummary, human_bytes

from .layout import Revision, cache_lock, check_cache_dir, write_lease
from .listpage import Started, empty_page, first_page
from .progress import Progress
from .source import S3Source, source_error
from .store import head, kind, open_store
from .trace import mark

if TYPE_CHECKING:
    from .store import AnyStore
    from .sync_options import SyncOptions


def sync(opts: SyncOptions, progress: Progress | None = None) -> StageSummary:
    """Run ``dscache-stage sync`` for ``opts`` (a sync.SyncOptions)."""
    progress = progress or Progress()
    started = time.monotonic()
    mark("start")
    c = opts.cache_dir
    check_cache_dir(c)
    rev = Revision(c, opts.revision)
    # A complete revision never changes, so its manifest can be read unlocked.
    probe = rev.first_key() if rev.read_complete() is not None else None
    if probe is None:
        # Most likely a cold run: import its modules (asyncio, the native plane: ~0.1 s of CPU)
        # on a thread while this one waits on the network for the access proof and the lock.
        threading.Thread(target=_import_cold_path, name="import-cold", daemon=True).start()
    store = open_store(opts.source, opts.concurrency)
    # A cold run that may take its listing from a peer, or lists versions, needs no first page.
    elsewhere = opts.as_of is not None or bool(opts.agent and opts.cache and opts.peer_token_file)
    listing = prove_access(store, opts.source, probe, elsewhere)
    mark("first-page", len(listing.first) if listing is not None else 0)
    one_page = probe is None and onepage_fits(opts, listing)
    if probe is None and not one_page:
        # Not a one-page copy (onepage.fits): asyncio's path, imported meanwhile too.
        threading.Thread(target=_import_sync, name="import-sync", daemon=True).start()

    def on_wait() -> None:
        progress.note(f"another stager or a wipe holds {contract.lock_path(c)}; waiting for it")

    with cache_lock(c, on_wait):
        if opts.pod_uid:
            write_lease(c, opts.revision, opts.pod_uid)
        if rev.read_complete() is not None and rev.sealed_before_boot():
            progress.note(
                f"revision {opts.revision} was completed before this node last booted and "
                "nothing was fsynced: staging it again"
            )
            rev.remove()
        if (done := rev.read_complete()) is not None:
            progress.note(
                f"revision {opts.revision} is already complete on this node: "
                f"{done.objects} objects, {human_bytes(done.bytes)}; nothing to list or copy"
            )
            return StageSummary(
                objects=done.objects,
                bytes=done.bytes,
                skipped=done.objects,
                seconds=time.monotonic() - started,
                revision=opts.revision,
                warm=True,
            )
        gc_from_here()

        if opts.agent and opts.cache and opts.bytes is not None:
            from .room import ask

            ask(
                opts.agent,
                opts.cache,
                opts.revision,
                opts.bytes,
                progress,
                _token(opts.peer_token_file),
                prestage=opts.prestage,
            )
        progress.note(
            f"staging revision {opts.revision} of {opts.source.uri} into {rev.dir} "
            f"({opts.concurrency} requests in flight)"
        )
        if one_page and listing is not None:
            from . import onepage

            summary = onepage.cold(opts, rev, store, progress, listing)
        else:
            from .sync import cold

            summary = cold(opts, rev, store, progress, listing if opts.as_of is None else None)
        mark("done", summary.objects)
        return summary


def onepage_fits(opts: SyncOptions, listing: Started | None) -> bool:
    """Whether the cold copy runs without asyncio (onepage.fits; onepage.py is on the import thread's list)."""
    from .onepage import fits

    return fits(opts, listing)


def gc_from_here() -> None:
    """Collect garbage again, if cli.entry turned it off for start-up, leaving what start-up made out.

    A cold copy allocates for as long as it lists (1M keys: minutes); the modules and classes
    loaded so far live as long as the process, so they go to the permanent generation (freeze)
    and no full collection walks them again.
    """
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _token(path: str | None) -> str:
    """The pod's projected token for the agents (reservations need it); "" without one."""
    if not path:
        return ""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _import_cold_path() -> None:
    # Only what every cold copy needs, without asyncio: a one-page revision (onepage.py) never
    # imports it (~40 ms after a page-cache drop); the others import sync.py once the access
    # proof's page shows them (_import_sync). An error here (none is expected) surfaces again
    # where the module is imported for real.
    with contextlib.suppress(Exception):
        from . import native, onepage  # noqa: F401

        native.load()  # the extension's shared object, loaded on first use otherwise


def _import_sync() -> None:
    with contextlib.suppress(Exception):
        from . import sync  # noqa: F401


def prove_access(store: AnyStore, source: S3Source, probe_key: str | None, empty: bool = False) -> Started | None:
    """One request with this process's credentials; raise SourceError if S3 refuses.

    A HEAD of an object we are about to serve proves GetObject on it; when it
    is gone (404) or there is no manifest yet, one listing page proves
    ListBucket on the prefix. A cold run needs that very page first, so it is
    returned with the listing's stream, for the copy to go on from (sync.py):
    the server lists it once, and the copy starts a round trip sooner. ``empty``: the listing
    comes from elsewhere; an empty page proves ListBucket as well, for a few hundred bytes.
    """
    source.check_reachable()
    try:
        # Not found: deleted since; the copy on the node is still whole, so prove access by listing.
        if probe_key is not None and head(store, probe_key):
            return None
        if empty:
            empty_page(store, source.prefix)
            return None
        return first_page(store, source.prefix)
    except Exception as e:
        if (failed := kind(e)) is None:
            raise
        if failed == "invalid_path":
            return None  # S3 answered with keys the client cannot represent: access is proven; the listing names them
        raise source_error(e, source, 0) from e

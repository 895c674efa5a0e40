"""The S3 client a run lists and HEADs with: dscache_native's Store on the common path, obstore's
S3Store otherwise; and the errors of both, told apart by kind.

Issue 30: a cold start imported two S3 clients built on the same Rust crate (object_store),
obstore's for the listing, the access proof and the HEADs, and dscache_native's Copier for the
GETs. After a page-cache drop the process read obstore's 15 MiB extension for a few requests
the native plane can make as well (native/src/list.rs). Where the native module loads and the
credentials are static keys in the environment (a Secret's), the stager lists and HEADs through
it and never imports obstore; obstore stays the fallback: without the extension (or with
DSCACHE_NATIVE=0), with any other credential source (boto3's chain, which obstore refreshes; no
credentials at all, a public bucket), and for fetch.py's Python data plane (opened lazily there,
at its first request: see fetch.Fetcher), which peers' turns use on either plane.

Kept light: the warm start imports this module for one HEAD, so no asyncio (imported by the
async helpers when they run, on the cold path, where it is loaded already) and no obstore.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .switches import env_flag

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor
    from typing import TypeAlias

    from obstore.store import S3Store

    from .source import S3Source

    #: Either client, as open_store answers.
    AnyStore: TypeAlias = "NativeStore | S3Store"

#: "0" turns the native data plane off (the pure-Python path runs); unset or "1": on when installed.
ENV = "DSCACHE_NATIVE"

#: (key, size, ETag unquoted or "") of one listed object, from either client.
Listed = tuple[str, int, str]


def load_native() -> ModuleType | None:
    """dscache_native, unless it is absent or switched off."""
    if not env_flag(ENV, True):
        return None
    try:
        import dscache_native
    except ImportError:
        return None
    return dscache_native


# --- errors ---------------------------------------------------------------------------------


class StoreError(Exception):
    """A request S3 (or the client) failed on the native plane: obstore's BaseError's counterpart,
    so that raising it needs no obstore. ``kind`` says which, as :func:`kind` answers."""

    kind = "generic"


class GenericError(StoreError):
    """Anything else: worth another try (obstore's GenericError)."""


class PreconditionError(StoreError):
    """If-Match failed: the object changed since it was listed."""

    kind = "precondition"


class PermissionDeniedError(StoreError):
    kind = "permission"


class UnauthenticatedError(StoreError):
    kind = "unauthenticated"


class InvalidPathError(StoreError):
    """A listed key object_store cannot represent (empty segments, '.', '..', control characters)."""

    kind = "invalid_path"


ERRORS: dict[str, type[StoreError]] = {
    "precondition": PreconditionError,
    "permission": PermissionDeniedError,
    "unauthenticated": UnauthenticatedError,
    "invalid_path": InvalidPathError,
}

#: Failures no retry can mend: access is refused, or a key cannot be represented.
REFUSALS = ("permission", "unauthenticated", "invalid_path")

#: obstore's exception classes by name, as the kinds above.
_OBSTORE_KINDS = {
    "PreconditionError": "precondition",
    "PermissionDeniedError": "permission",
    "UnauthenticatedError": "unauthenticated",
    "InvalidPathError": "invalid_path",
}


def kind(e: BaseException) -> str | None:
    """Which S3 failure ``e`` is (precondition, permission, unauthenticated, invalid_path or
    generic), from either client; None when it is no S3 client's error at all.

    obstore's classes are looked at only when obstore was imported: if it was not, it raised nothing.
    """
    if isinstance(e, StoreError):
        return e.kind
    exceptions = sys.modules.get("obstore.exceptions")
    if exceptions is not None and isinstance(e, exceptions.BaseError):
        return _OBSTORE_KINDS.get(type(e).__name__, "generic")
    return None


def failure(kind_: str, message: str) -> StoreError:
    """A native failure tuple's kind and message as the exception raised for it."""
    return ERRORS.get(kind_, GenericError)(message)


# --- the client -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NativeStore:
    """dscache_native.Store: listing and HEADs without obstore."""

    store: Any  # dscache_native.Store (the extension's stubs: native/dscache_native.pyi)

    def head(self, key: str) -> bool:
        """Whether ``key`` exists (False: 404); raises a StoreError on any other failure."""
        found, failed = self.store.head(key)
        if failed is not None:
            raise failure(failed[0], failed[2])
        return found is not None

    def pages(self, prefix: str, offset: str | None, chunk: int) -> NativePages:
        """The listing of ``prefix`` (after ``offset``), ``chunk`` objects at a time, blocking."""
        return NativePages(self.store.list(prefix, offset, chunk))


class NativePages(Iterator[list[Listed]]):
    """dscache_native.Pages as an iterator of batches: each ``next`` blocks (the GIL released) for
    as long as the page takes; ``cancel`` (from any thread) ends one in flight at once."""

    def __init__(self, pages: Any) -> None:
        self.pages = pages  # dscache_native.Pages
        self.failed: tuple[str, int, str, str] | None = None
        self.done = False

    def __next__(self) -> list[Listed]:
        if self.failed is not None:
            pending, self.failed, self.done = self.failed, None, True
            raise failure(pending[0], pending[2])
        if self.done:
            raise StopIteration
        batch: list[Listed]
        failed: tuple[str, int, str, str] | None
        batch, failed = self.pages.next()
        if failed is not None:
            if batch:
                self.failed = failed  # what was listed first, then the failure: resumed after it
                return batch
            self.done = True
            raise failure(failed[0], failed[2])
        if not batch:
            self.done = True
            raise StopIteration
        return batch

    def cancel(self) -> None:
        self.pages.cancel()


async def pages_async(pages: NativePages) -> AsyncIterator[list[Listed]]:
    """``pages`` from the event loop: each page fetched on a thread, the copier going on meanwhile;
    a listing abandoned (cancelled, closed) cancels the page in flight, so no thread outlives it
    for long (asyncio.run waits for its threads)."""
    import asyncio

    try:
        while (batch := await asyncio.to_thread(next, pages, None)) is not None:
            yield batch
    finally:
        pages.cancel()


def open_store(source: S3Source, concurrency: int) -> AnyStore:
    """The client for the access proof, the listing and the HEADs of empty objects.

    dscache_native's when it loads and the credentials are static keys in the environment, the
    common case (a Secret); otherwise obstore's (source.open_store), which refreshes boto3's
    chain itself. The native one is built from the same settings (source.store_settings)."""
    module = load_native()
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if module is None or not (key and secret):
        return source.open_store(concurrency)
    return NativeStore(
        module.Store(
            source.bucket,
            source.store_settings(concurrency),
            access_key_id=key,
            secret_access_key=secret,
            session_token=os.environ.get("AWS_SESSION_TOKEN") or None,
        )
    )


def head(store: AnyStore, key: str) -> bool:
    """Whether ``key`` exists: HEAD (False on 404); other failures raise."""
    if isinstance(store, NativeStore):
        return store.head(key)
    import obstore

    try:
        obstore.head(store, key)
        return True
    except FileNotFoundError:
        return False


#: Threads for the native HEADs of empty objects (sync._settle_empties): made as they are needed,
#: up to this many, so that as many HEADs fly as the run's request limit lets through (asyncio's
#: default executor has min(32, CPUs + 4): 6 on 2 cores). Each blocks without the GIL.
HEAD_THREADS = 64
_head_pool: ThreadPoolExecutor | None = None


async def exists(store: AnyStore, key: str) -> bool:
    """:func:`head` from the event loop (the native HEAD on a thread, obstore's async)."""
    if isinstance(store, NativeStore):
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        global _head_pool
        if _head_pool is None:
            _head_pool = ThreadPoolExecutor(HEAD_THREADS, thread_name_prefix="native-head")
        return await asyncio.get_running_loop().run_in_executor(_head_pool, store.head, key)
    import obstore

    try:
        await obstore.head_async(store, key)
        return True
    except FileNotFoundError:
        return False


def listed(batch: Any) -> list[Listed]:
    """obstore's ObjectMeta dicts as (key, size, ETag unquoted)."""
    return [(o["path"], o["size"], (o.get("e_tag") or "").strip('"')) for o in batch]


async def list_async(store: AnyStore, prefix: str, offset: str | None, chunk: int) -> AsyncIterator[list[Listed]]:
    """The listing of ``prefix`` after ``offset``, a chunk at a time, from the event loop."""
    if isinstance(store, NativeStore):
        async for batch in pages_async(store.pages(prefix, offset, chunk)):
            yield batch
        return
    import obstore

    async for page in obstore.list(store, prefix=prefix or None, offset=offset, chunk_size=chunk):
        yield listed(page)

"""A listing's first page: the access proof's (stage.py), which the cold copy goes on from
(listing.py); or, when the listing may come from a peer, an empty page (``empty_page``).
Kept apart from listing.py so that a warm start, which needs only this page, does not import
the cold path (asyncio, the copier). Either client (store.py) serves it: the native one on the
common path, obstore's otherwise."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from .store import REFUSALS, Listed, NativePages, NativeStore, kind

if TYPE_CHECKING:
    from obstore import ListStream, ObjectMeta

    from .store import AnyStore

T = TypeVar("T")

#: Tries of one listing page that fails mid-body (obstore retries the rest itself); also the resumed listing's.
LIST_ATTEMPTS = 8
#: Objects per listing batch: one ListObjectsV2 page (S3 sends at most 1,000 keys a page).
LIST_CHUNK = 1000


@dataclass(slots=True)
class Started:
    """A listing already begun by prove_access: its first batch, and its stream to go on
    with (None: that batch was the whole listing). The access proof is one listing page, the
    one the copy needs first; handing it on (listing.list_objects) saves a round trip and the
    server listing it twice."""

    first: list[Listed]
    #: The native client's pages (blocking: polled on a thread), or obstore's stream.
    rest: NativePages | ListStream[Sequence[ObjectMeta]] | None


def first_page(store: AnyStore, prefix: str) -> Started:
    """One ListObjectsV2 page, retried when its body is cut short (the clients retry the rest themselves)."""

    def page() -> Started:
        if isinstance(store, NativeStore):
            pages = store.pages(prefix, None, LIST_CHUNK)
            first = next(pages, None)
            if first is None:
                return Started([], None)
            # A short chunk is the listing's last (native/src/list.rs: fewer than ``chunk`` only
            # at its end), unless a failure cut it short (pages.failed, raised by the next call).
            # Knowing it here lets a one-page revision be copied without asyncio (onepage.py).
            ended = len(first) < LIST_CHUNK and pages.failed is None
            return Started(first, None if ended else pages)
        import obstore

        from .store import listed

        stream = obstore.list(store, prefix=prefix or None, chunk_size=LIST_CHUNK)
        try:
            return Started(listed(next(stream)), stream)
        except StopIteration:
            return Started([], None)  # nothing under the prefix

    return _retried(page)


#: A start-after past every key under a prefix: U+10FFFF is the last code point, and S3 orders
#: keys by their UTF-8 bytes, so the page after it is empty but for keys that begin with it.
PAST_EVERY_KEY = "\U0010ffff"


def empty_page(store: AnyStore, prefix: str) -> None:
    """One ListObjectsV2 under ``prefix`` that starts after every key: the bucket checks
    s3:ListBucket on the prefix and answers a page of (nearly always) no keys, a few hundred
    bytes, where a first page of 1,000 keys is ~300 KB. For a cold run whose listing may come
    from a peer (peer_listing.py); the errors are first_page's."""

    def page() -> None:
        # A key past U+10FFFF proves access all the same: the first chunk is enough.
        if isinstance(store, NativeStore):
            next(store.pages(prefix, prefix + PAST_EVERY_KEY, 1), None)
            return
        import obstore

        next(obstore.list(store, prefix=prefix or None, offset=prefix + PAST_EVERY_KEY, chunk_size=1), None)

    _retried(page)


def _retried(page: Callable[[], T]) -> T:
    """``page()``, tried again (with jittered backoff) when S3 failed it for a reason that may
    pass; refusals (access, keys the clients cannot represent, no such bucket) are raised at once."""
    for attempt in range(1, LIST_ATTEMPTS + 1):
        try:
            return page()
        except Exception as e:
            failed = kind(e)
            if failed is None or failed in REFUSALS or attempt == LIST_ATTEMPTS or "NoSuchBucket" in str(e):
                raise
            time.sleep(random.uniform(0, 0.1 * 2**attempt))
    raise AssertionError("unreachable")

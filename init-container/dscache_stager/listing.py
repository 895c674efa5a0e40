"""List a prefix as one ordered stream of objects, a page ahead of the copier.

Listing overlaps copying: objects flow to the copier page by page, so the
first bytes move within a second even on prefixes with millions of keys, and
memory holds a few pages, never the whole listing.

One flat listing, in S3's order (keys in UTF-8 byte order), and not a fan-out
over sub-prefixes: the revision digest (dscache_contract.RevisionHasher) is
defined over the listing in that order, and a single stream feeds it with
O(1) memory. Parallel listers would need the later ranges buffered until the
earlier ones finish. A prefetch task keeps the next pages coming while the
current one is processed, which hides most of the round trips.

Measured on a loopback versitygw (4,000 keys): boto3 spends 0.17 ms of CPU
per key listed plus 0.5 s to import and build a client; obstore (Rust
object_store) 0.045 ms per key, all of it waiting on the server. boto3 would
hold the GIL the copier needs, so object_store lists: through dscache_native
(native/src/list.rs) on the common path, obstore otherwise (store.py says
when). Either normalises its paths alike:
 - a trailing '/' is dropped, so a directory marker ``a/`` shows up as an empty
   object ``a``; the digest uses the same normalised key (see the contract),
   and the copier settles empty objects in sync.py;
 - keys it cannot represent (empty segments, '.', '..', control characters)
   abort the listing. They are unsafe for us too, so we list again with boto3,
   which passes every key through, and the error names them all.

Where a cold copy of many pages idles (issue 30, smallwan36; DSCACHE_TRACE=1, trace.py, beside a
sampler of /proc/<pid>/stat every 20 ms; bench/stager.py's 5,000 x 64 KiB on its loopback versitygw,
the client and the server under SCHED_RR to keep the shared cores' other work out): the prefetch
asks for page N+1 as soon as page N is in, but the server answers it only once the GETs of page N
have all ended (asked at 0.55 s, answered at 0.88 s, 7 ms after the last of those GETs), at each of
the 4 page boundaries, with 256 or 32 requests in flight, into ext4 or tmpfs, from this process or
another; a HEAD meanwhile waited 50-80 ms. So the copy runs dry at each boundary while the server
walks the next page alone (~30-50 ms each), ~10% of a 1.6 s copy. Not cut here, because listing
ahead did not help: the whole listing first (~1.86 s against 1.76, 4 runs each), the rest fanned
out over the prefix's common prefixes, 32 at once (1.665 against 1.652 s, 3 each; the fanned
requests too were answered only at drains, and 80 of them cost the server 0.13 s more CPU), or in
~700-key ranges asked for at once from a delimited listing taken with the first page (1.679
against 1.662 s, 4 each; answered at the first drain, but the server then walked them all, and
past their ends). A server that answers listings while it serves GETs (S3) pays none of it.

A revision pinned in a versioned bucket (``--as-of``) is listed with boto3's
ListObjectVersions instead (obstore lists no versions): per key, the version
the revision means (dscache_contract.versions), with its versionId for the
GET. Its pages are fetched in a worker thread, a few pages ahead, like the rest.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from dscache_contract import VersionPicker, normalize_key, page_versions, parse_as_of

from .errors import SourceError, StageError, TransientError
from .listpage import LIST_ATTEMPTS, LIST_CHUNK, Started
from .objects import RemoteObject, UnrepresentableKeys, remote_objects
from .source import S3Source
from .store import REFUSALS, Listed, NativePages, kind, list_async, listed, pages_async
from .trace import mark

if TYPE_CHECKING:
    from .store import AnyStore


async def _resumed(started: Started) -> AsyncIterator[list[Listed]]:
    yield started.first
    rest = started.rest
    # The same stream, polled from the loop now: S3's continuation token carries it on, so no
    # key is listed twice or missed (a start-after from the last key could not tell "a" from
    # a marker "a/", which the clients list alike).
    if isinstance(rest, NativePages):  # blocking: each page on a thread
        async for batch in pages_async(rest):
            yield batch
    elif rest is not None:  # obstore's stream
        async for page in rest:
            yield listed(page)


async def _pages(store: AnyStore, prefix: str, started: Started | None = None) -> AsyncIterator[list[RemoteObject]]:
    """One listing, resumed after the last key seen when a page fails mid-body.

    obstore retries failed requests, but not a connection dropped while a
    page's body streams; S3's start-after lets us pick up exactly there.
    """
    last: str | None = None
    # obstore strips a directory marker's trailing '/', which can move it in
    # the order; after a resume, drop anything the last pages already gave.
    previous: set[str] = set()
    older: set[str] = set()
    failures = 0
    while True:
        try:
            if started is not None:
                batches: AsyncIterator[list[Listed]] = _resumed(started)
                started = None  # a failure resumes with a listing of its own, from the last key
            else:
                batches = list_async(store, prefix, last, LIST_CHUNK)
            async for batch in batches:
                objs = remote_objects(batch)
                if failures:
                    objs = [o for o in objs if o.key not in previous and o.key not in older]
                if objs:
                    last = objs[-1].key
                    older, previous = previous, {o.key for o in objs}
                    failures = 0
                    mark("page", len(objs))
                    yield objs
            return
        except Exception as e:
            if (failed := kind(e)) is None or failed in REFUSALS:
                raise
            failures += 1
            if failures >= LIST_ATTEMPTS or "NoSuchBucket" in str(e):
                raise
            await asyncio.sleep(random.uniform(0, 0.1 * 2**failures))


PREFETCH_PAGES = 4


async def list_objects(
    store: AnyStore, prefix: str, started: Started | None = None
) -> AsyncIterator[list[RemoteObject]]:
    """Yield batches of objects under ``prefix`` in listing order, each object exactly once
    (going on with ``started``, the access proof's listing, when there is one)."""
    async for batch in _prefetched(_pages(store, prefix, started)):
        yield batch


async def list_versions(source: S3Source, as_of: str) -> AsyncIterator[list[RemoteObject]]:
    """Yield, in listing order, the version of each key that a revision pinned
    ``as_of`` means (delete markers and keys born later left out)."""
    picker = VersionPicker(parse_as_of(as_of))
    pages = _version_pages(source)

    async def picked() -> AsyncIterator[list[RemoteObject]]:
        while (page := await asyncio.to_thread(next, pages, None)) is not None:
            yield [
                RemoteObject(normalize_key(v.key), v.size, v.etag.strip('"'), v.version_id, v.key.endswith("/"))
                for v in picker.feed(page_versions(page))
                if not v.deleted
            ]

    async for batch in _prefetched(picked()):
        yield batch


def _version_pages(source: S3Source) -> Iterator[dict[str, Any]]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        paginator = boto3_client(source).get_paginator("list_object_versions")
        yield from paginator.paginate(Bucket=source.bucket, Prefix=source.prefix)
    except (BotoCoreError, ClientError) as e:
        raise boto3_error(e, source) from e


async def _prefetched(pages: AsyncIterator[list[RemoteObject]]) -> AsyncIterator[list[RemoteObject]]:
    """Keep up to PREFETCH_PAGES pages coming while the caller works on the current one."""
    out: asyncio.Queue[list[RemoteObject] | BaseException | None] = asyncio.Queue(maxsize=PREFETCH_PAGES)

    async def produce() -> None:
        try:
            async for batch in pages:
                await out.put(batch)
            await out.put(None)
        except Exception as e:
            await out.put(UnrepresentableKeys(str(e)) if kind(e) == "invalid_path" else e)

    producer = asyncio.create_task(produce())
    try:
        while (item := await out.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # Leave no listing in flight: obstore futures must not outlive the loop (a native page
        # in flight finishes on its thread, which asyncio.run's shutdown waits for).
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)


def list_keys_raw(source: S3Source) -> list[str]:
    """Every key under the prefix, verbatim, through boto3 (slow but exact)."""
    keys: list[str] = []
    paginator = boto3_client(source).get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=source.bucket, Prefix=source.prefix):
        keys.extend(o["Key"] for o in page.get("Contents", []))
    return keys


def boto3_client(source: S3Source) -> Any:
    """A boto3 S3 client that talks to the bucket as obstore does (the contract's region and style).

    Credentials come from boto3's own chain (environment, web identity, roles).
    """
    import boto3
    from botocore.config import Config

    from dscache_contract import resolve_addressing_style, resolve_region

    style = resolve_addressing_style(source.endpoint_url, source.addressing_style)
    return boto3.client(
        "s3",
        endpoint_url=source.endpoint_url,
        region_name=resolve_region(source.region),
        config=Config(s3={"addressing_style": style}, retries={"mode": "adaptive", "max_attempts": 10}),
    )


def boto3_error(e: Exception, source: S3Source) -> StageError:
    """A boto3 failure as the stager reports it: access (3), or S3 kept failing (7)."""
    where = f"{source.uri}" + (f" at {source.endpoint_url}" if source.endpoint_url else "")
    response: dict[str, Any] = getattr(e, "response", None) or {}
    code = response.get("Error", {}).get("Code", "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken") or status == 403:
        return SourceError(
            f"access denied listing the versions of {where} with this pod's credentials ({code or status}): "
            f"a revision pinned in a versioned bucket needs s3:ListBucketVersions and s3:GetObjectVersion"
        )
    if code == "NoSuchBucket":
        return SourceError(f"no such bucket: {source.bucket}; check the bucket name, region and endpoint")
    return TransientError(f"S3 kept failing for {where} after retries with backoff: {code or e}; re-run to resume")

"""Pinning a revision: one listing of the source, and in a versioned bucket a time to find it again.

Both sides list with boto3 through :func:`pin` (the operator on every source
check, the stager's ``revision`` command), so a pin means the same thing
wherever it is made.

Unversioned bucket (or versioning Suspended, or not readable): the revision is
the digest of the ListObjectsV2 listing, and a pod can be served only while
every pinned object keeps its ETag (every GET carries If-Match).

Versioned bucket (versioning Enabled): the digest also covers each object's
versionId (revision.py), and the pin carries ``as_of``, a time on the
server's clock. A stager lists every version (ListObjectVersions) and takes,
per key, the newest entry whose LastModified is not after ``as_of`` (a delete
marker there means: not in the dataset), then GETs exactly those versionIds.
So a Job keeps its bytes after objects are overwritten or deleted, for as
long as the bucket keeps the old versions. Why a time and not the versionIds
themselves: a pod can carry a few bytes in an annotation, not a listing of a
million keys, and the digest still proves the stager found the very same
versions (if not, it fails; it never serves a mix).

Why ``as_of`` finds exactly the pinned versions: S3's LastModified has a
resolution of one second. ``as_of`` is the newest LastModified among the
entries picked (versions and delete markers). :func:`pin` accepts a listing
only when ``as_of`` is at least two seconds older than the server's Date on a
request made just before the listing began; every version the listing could
have missed was written after that request, so its LastModified is newer
than ``as_of`` (one spare second for clocks of different S3 frontends). A
prefix still being written is listed again after a pause; one that never
settles is pinned anyway, and a stager that then picks differently fails on
the digest with a clear reason.

A pinned revision travels as one value, :class:`RevisionRef` (id and as-of
time together), from the listing (:attr:`Pin.ref`) through status and the
webhook to the pod's annotations and the stager's argv: an as-of time means
something only for the listing its id digests, so the two are never passed apart.

Standard library only (see __init__): the caller passes a boto3 client in.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .clock import RFC3339, fmt_epoch, parse_time
from .names import ANNOTATION_AS_OF, ANNOTATION_REVISION
from .paths import validate_revision
from .revision import RevisionHasher
from .selection import Selection

#: How much older than the server's clock at the start of the listing as_of must be.
SETTLE_SECONDS = 2
#: Listings tried before a prefix that keeps changing is pinned as it is.
PIN_ATTEMPTS = 4


def format_as_of(epoch: int) -> str:
    """Seconds since the epoch as the RFC 3339 UTC form the API and argv carry."""
    return fmt_epoch(epoch)


def parse_as_of(text: str) -> int:
    """The inverse of :func:`format_as_of`; ValueError for anything else."""
    try:
        when = datetime.datetime.strptime(text, RFC3339)
    except (TypeError, ValueError):
        raise ValueError(f"as-of must be a UTC time like 2026-01-31T12:00:00Z, got {text!r}") from None
    return int(when.replace(tzinfo=datetime.UTC).timestamp())


@dataclass(frozen=True, slots=True)
class ObjectVersion:
    """One entry of ListObjectVersions: a version of a key, or a delete marker."""

    key: str  # verbatim, as listed
    version_id: str
    last_modified: int  # epoch seconds (S3's resolution)
    size: int = 0
    etag: str = ""
    deleted: bool = False  # a delete marker
    latest: bool = False


def _epoch(value: Any) -> int:
    if isinstance(value, datetime.datetime):
        return int(value.timestamp())
    when = parse_time(str(value))
    if when is None:
        raise ValueError(f"LastModified is no timestamp: {value!r}")
    return int(when.timestamp())


def page_versions(page: dict[str, Any]) -> list[ObjectVersion]:
    """A boto3 ListObjectVersions page, in S3's order: by key, newest first.

    boto3 returns versions and delete markers as two lists; they are merged back
    by (key, newer first, the latest first). The sort is stable, so entries of
    one list keep S3's order; only a version and a delete marker of one key in
    the same second can come out in the wrong order, and then the digest says so.
    """
    out = [
        ObjectVersion(
            v["Key"],
            str(v.get("VersionId") or "null"),
            _epoch(v["LastModified"]),
            int(v.get("Size", 0)),
            str(v.get("ETag") or ""),
            False,
            bool(v.get("IsLatest")),
        )
        for v in page.get("Versions") or []
    ]
    out += [
        ObjectVersion(
            d["Key"], str(d.get("VersionId") or "null"), _epoch(d["LastModified"]), 0, "", True, bool(d.get("IsLatest"))
        )
        for d in page.get("DeleteMarkers") or []
    ]
    out.sort(key=lambda v: (v.key, -v.last_modified, not v.latest))
    return out


class VersionPicker:
    """Per key, the entry a revision means: the newest one not after ``as_of``
    (None: the newest of all). Feed entries in S3's order, page after page; a
    key's versions may span pages. Delete markers are returned too: the
    caller drops them from the dataset, and :func:`pin` dates ``as_of`` by them."""

    def __init__(self, as_of: int | None) -> None:
        self.as_of = as_of
        self._key: str | None = None
        self._done = False

    def feed(self, entries: Iterable[ObjectVersion]) -> Iterator[ObjectVersion]:
        for v in entries:
            if v.key != self._key:
                self._key, self._done = v.key, False
            if self._done or (self.as_of is not None and v.last_modified > self.as_of):
                continue
            self._done = True
            yield v


@dataclass(frozen=True, slots=True)
class RevisionRef:
    """One pinned revision: its id and, in a versioned bucket, its versions time.

    Both are checked on construction, and ``as_of`` must be in the canonical
    form :func:`format_as_of` writes, so two refs to one revision compare equal.
    Why not :class:`Pin`: a pod carries the revision, not the listing's counts.
    """

    id: str
    as_of: str | None = None

    def __post_init__(self) -> None:
        validate_revision(self.id)
        if self.as_of is not None and format_as_of(parse_as_of(self.as_of)) != self.as_of:
            raise ValueError(f"as-of must be a UTC time like 2026-01-31T12:00:00Z, got {self.as_of!r}")

    @property
    def versioned(self) -> bool:
        return self.as_of is not None

    def to_annotations(self) -> dict[str, str]:
        """The pod (or pod template) annotations that record this revision."""
        out = {ANNOTATION_REVISION: self.id}
        if self.as_of is not None:
            out[ANNOTATION_AS_OF] = self.as_of
        return out

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, Any], cache: str) -> RevisionRef | None:
        """The revision an object already carries (None: none yet). A malformed or
        orphaned pair is refused (ValueError naming the annotation and the fix),
        never replaced: replacing it could give one Job's pods two revisions."""
        rev, as_of = annotations.get(ANNOTATION_REVISION), annotations.get(ANNOTATION_AS_OF)
        if rev is None:
            if as_of is None:
                return None
            # An as-of time alone would be paired with whatever revision the cache
            # has now: a time that belongs to another listing, or to none.
            raise ValueError(
                f"DatasetCache {cache!r}: annotation {ANNOTATION_AS_OF}={as_of!r} is set without "
                f"{ANNOTATION_REVISION}; an as-of time belongs to one revision. Remove it to get the "
                f"cache's current revision, or set {ANNOTATION_REVISION} to the revision it belongs to."
            )
        try:
            validate_revision(rev)
        except ValueError as e:
            raise ValueError(
                f"DatasetCache {cache!r}: annotation {ANNOTATION_REVISION}={rev!r} is not a revision id "
                f"({e}); remove it to get the cache's current revision (kubectl get dsc {cache} "
                f"-o jsonpath='{{.status.revision.id}}')."
            ) from None
        try:
            return cls(rev, as_of)
        except ValueError as e:
            raise ValueError(
                f"DatasetCache {cache!r}: annotation {ANNOTATION_AS_OF}={as_of!r} is malformed ({e}); remove "
                f"it together with {ANNOTATION_REVISION} to get the cache's current revision."
            ) from None


@dataclass(frozen=True)
class Pin:
    """A revision as the operator pins it; ``as_of`` only for a versioned bucket."""

    revision: str
    objects: int
    bytes: int
    as_of: str | None = None

    @property
    def versioned(self) -> bool:
        return self.as_of is not None

    @property
    def ref(self) -> RevisionRef:
        """The revision alone, as status, the webhook and pods carry it."""
        return RevisionRef(self.revision, self.as_of)


def versioning_enabled(client: Any, bucket: str) -> tuple[bool, int | None]:
    """Whether the bucket's versioning is Enabled, and the server's Date (epoch) on the answer.

    A server that refuses or does not implement GetBucketVersioning is treated
    as unversioned: pins then work as before, by ETag alone.
    """
    try:
        got = client.get_bucket_versioning(Bucket=bucket)
    except Exception as e:
        code = (getattr(e, "response", None) or {}).get("Error", {}).get("Code", "")
        if code in ("AccessDenied", "NotImplemented", "MethodNotAllowed", "XNotImplemented"):
            return False, None
        raise
    date = (got.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date")
    import email.utils  # here: ~6 ms to import, and the stager's cold start never needs it

    server_now = int(email.utils.parsedate_to_datetime(date).timestamp()) if date else None
    return got.get("Status") == "Enabled", server_now


def pin(
    client: Any,
    bucket: str,
    selection: Selection,
    sleep: Callable[[float], None] = time.sleep,
) -> Pin:
    """List the selection once (versioned: until it settles, see the module doc) and pin it."""
    for attempt in range(1, PIN_ATTEMPTS + 1):
        versioned, server_now = versioning_enabled(client, bucket)
        if not versioned:
            hasher = RevisionHasher()
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=selection.prefix):
                for item in page.get("Contents", []):
                    if selection.relative(item["Key"]) is not None:
                        hasher.add(item["Key"], int(item.get("Size", 0)), item.get("ETag"))
            return Pin(hasher.revision_id(), hasher.objects, hasher.bytes)
        hasher, as_of = RevisionHasher(), 0
        picker = VersionPicker(None)
        paginator = client.get_paginator("list_object_versions")
        for page in paginator.paginate(Bucket=bucket, Prefix=selection.prefix):
            for v in picker.feed(page_versions(page)):
                if selection.relative(v.key) is None:
                    continue
                as_of = max(as_of, v.last_modified)
                if not v.deleted:
                    hasher.add(v.key, v.size, v.etag, v.version_id)
        if server_now is None or as_of + SETTLE_SECONDS <= server_now or attempt == PIN_ATTEMPTS:
            return Pin(hasher.revision_id(), hasher.objects, hasher.bytes, format_as_of(as_of))
        # Written within the last seconds: versions written right after this
        # listing could share as_of's second. Let the second pass, list again.
        sleep(min(SETTLE_SECONDS, as_of + SETTLE_SECONDS - server_now) + 0.1)
    raise AssertionError("unreachable")

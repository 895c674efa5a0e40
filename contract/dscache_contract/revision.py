"""The revision digest: which exact listing a pod was admitted with.

A revision pins the selected listing of a source: every selected object's
(key, size, ETag, versionId) in listing order. Listing order is S3's: keys in
UTF-8 byte order, which both boto3 (operator) and obstore (stager) pass
through unchanged. Feed objects in that order, after Selection.relative said
they belong.

Canonical encoding (version 1), fed to sha256:

    b"dscache-revision-v1\\n"
    per object:  ns(key) ns(str(size)) ns(etag) (ns(version_id) | b"-")
    where ns(s) = b"%d:%s," % (len(b), b) with b = s encoded as UTF-8 (a netstring)

- key: the full key with one trailing '/' dropped (selection.normalize_key);
- size: decimal, no sign or leading zeros;
- etag: without surrounding double quotes (and without a W/ prefix);
- version_id: None when the listing has none; today both sides list with
  ListObjectsV2 and pass None (pinning versionIds needs ListObjectVersions,
  and a stager that GETs by versionId; the encoding already leaves room).

Netstrings make the encoding unambiguous whatever a key contains, so two
different listings cannot encode to the same bytes.

revision_id() = "r-" + the first 20 hex digits of the sha256.
"""

from __future__ import annotations

import hashlib

from .selection import normalize_key

HEADER = b"dscache-revision-v1\n"
ID_HEX_DIGITS = 20


def normalize_etag(etag: str | None) -> str:
    e = (etag or "").strip()
    if e.startswith("W/"):
        e = e[2:]
    return e.strip('"')


def _ns(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return b"%d:%s," % (len(b), b)


class RevisionHasher:
    """Feed selected objects in listing order; read revision_id() at the end."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(HEADER)
        self.objects = 0
        self.bytes = 0

    def add(self, key: str, size: int, etag: str | None, version_id: str | None = None) -> None:
        size = int(size)
        if size < 0:
            raise ValueError(f"negative size {size} for {key!r}")
        record = _ns(normalize_key(key)) + _ns(str(size)) + _ns(normalize_etag(etag))
        record += _ns(version_id) if version_id is not None else b"-"
        self._h.update(record)
        self.objects += 1
        self.bytes += size

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def revision_id(self) -> str:
        return "r-" + self._h.hexdigest()[:ID_HEX_DIGITS]

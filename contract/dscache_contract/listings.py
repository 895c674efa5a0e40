"""The listing from a peer (issue 30): one node lists the bucket, the others take its listing.

Listing the bucket costs every node the listing's XML (a few hundred bytes per key): at 32 nodes
of a 264-key revision that was 0.15x of the dataset through the bucket's link, and at a million
keys it is minutes of ListObjectsV2 per node. A node whose listing hashed to the pinned revision
(``RevisionHasher``) keeps it as ``C/revs/<rev>/meta/listing.jsonl`` (written as
``tmp/listing.part`` while it lists, renamed when it is whole and checked), and its agent serves
it at ``LISTINGS_PATH`` behind the same token gate as objects. Another node's stager takes it from
there and uses it only if it hashes to the revision it was admitted with: a peer's listing is
trusted for nothing (the revision id is 80 bits of a sha256, so a peer that wants a different
listing to pass needs a second preimage).

Who lists (``listing_sources``): a node asks the nodes that hold the revision whole, then those
that started copying it before itself, earliest first, with a held request (``?wait=``), and lists
the bucket itself when none has it to give within a deadline; so the revision's earliest node
lists. Not a rendezvous ranking (``owner_ranking``): over a set that grows as nodes start, the
first node by weight changes each time a newcomer outranks them all, and every such newcomer
would list (about ln N of N nodes: 3 of 16 in bench/fanout.py); the earliest node stays earliest.

One line per object the revision hashes, in listing order: ``[key, size, etag, versionId or
null, marker]`` (JSON). ``marker`` (a versioned listing's directory marker ``a/``) is the one
field the revision does not cover; see dscache_stager.peer_listing.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.parse
from dataclasses import dataclass

from .paths import meta_dir, tmp_dir, validate_revision
from .peers import PeersAnswer, query_wait, split_target

#: ``GET /v1/listings/<namespace>/<cache>/<revision>?wait=<s>`` with the pod's peer token.
LISTINGS_PATH = "/v1/listings/"
#: The revision's whole, checked listing, and the one being written.
LISTING_NAME = "listing.jsonl"
LISTING_PART_NAME = "listing.part"
#: The longest an agent holds a request for a listing that is not whole yet.
MAX_LISTING_WAIT_S = 20.0
#: The 404 answer's JSON carries how many bytes of the listing are written so far (``listed``):
#: a node still listing is waited for while that grows.
LISTED_FIELD = "listed"


def listing_path(c: str, rev: str) -> str:
    return os.path.join(meta_dir(c, rev), LISTING_NAME)


def listing_part_path(c: str, rev: str) -> str:
    return os.path.join(tmp_dir(c, rev), LISTING_PART_NAME)


def listing_line(key: str, size: int, etag: str, version_id: str | None, marker: bool) -> str:
    return json.dumps([key, size, etag, version_id, marker], ensure_ascii=False, separators=(",", ":")) + "\n"


def parse_listing_line(line: str) -> tuple[str, int, str, str | None, bool]:
    """ValueError on anything but a line ``listing_line`` writes."""
    try:
        key, size, etag, version_id, marker = json.loads(line)
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a listing line: {line[:80]!r}") from e
    if not (
        isinstance(key, str)
        and isinstance(size, int)
        and not isinstance(size, bool)
        and size >= 0
        and isinstance(etag, str)
        and (version_id is None or isinstance(version_id, str))
        and isinstance(marker, bool)
    ):
        raise ValueError(f"not a listing line: {line[:80]!r}")
    return key, size, etag, version_id, marker


@dataclass(frozen=True)
class ListingRequest:
    namespace: str
    cache: str
    revision: str
    wait: float = 0.0

    def target(self) -> str:
        parts = "/".join(urllib.parse.quote(p, safe="") for p in (self.namespace, self.cache, self.revision))
        return f"{LISTINGS_PATH}{parts}" + (f"?wait={self.wait:g}" if self.wait > 0 else "")

    @classmethod
    def parse(cls, target: str) -> ListingRequest:
        """ValueError if malformed."""
        parts, query = split_target(target, LISTINGS_PATH)
        if len(parts) != 3 or not all(parts):
            raise ValueError("a listing path is /v1/listings/<namespace>/<cache>/<revision>")
        return cls(parts[0], parts[1], validate_revision(parts[2]), query_wait(query, MAX_LISTING_WAIT_S))


def listing_sources(answer: PeersAnswer) -> list[str]:
    """The nodes ``answer.me`` asks for the listing, in order ([]: it lists the bucket itself): those
    that hold the revision whole (in an order of their own, so not every node asks the same one),
    then those that started copying it before this node, earliest first (ties by address)."""
    me = answer.me
    complete = sorted(
        (p.addr for p in answer.complete if p.addr != me),
        key=lambda a: hashlib.sha256(f"{a}\n{me}".encode()).digest(),
    )
    mine = next((p.since for p in answer.staging if p.addr == me), None)
    earlier = sorted(
        (p.since, p.addr)
        for p in answer.staging
        if p.addr != me and p.addr not in complete and (mine is None or (p.since, p.addr) < (mine, me))
    )
    return complete + [addr for _, addr in earlier]

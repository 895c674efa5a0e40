"""What a copy is made of, without asyncio: the listed objects, a GET's result and the size
limits that choose how each is fetched. Shared by the asyncio copy (sync.py, listing.py,
fetch.py) and the one-page copy (onepage.py), which must not import asyncio (issue 30)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import Listed

# Objects up to SMALL_LIMIT are one GET held in memory; the requests fetch.py
# makes are at most sync_options.BUFFER_BYTES / SMALL_LIMIT (64), so
# memory stays under 64 MiB of bodies. Larger ones stream in parts.
SMALL_LIMIT = 1 << 20
# 32 MiB parts, not 16 (issue 30, third round; the module docstring has the
# sweeps): the same bytes in half the ranged GETs cost the loopback server
# 20-25% less CPU in every sweep, and the copy 8-15% less wall at load 6-8
# (within the noise at load 15-20), for both planes and for the bench's
# ceiling alike; 64 MiB ranges doubled the server's CPU. Real S3 is
# served the same way (s5cmd's parts are 50 MB), and parts in flight, which
# bound its throughput per connection, stay SPLICE_THREADS.
PART_SIZE = 32 << 20
#: Ranged parts spliced at once (each on its own thread and connection).
SPLICE_THREADS = 16
# obstore retries each request; a connection dropped mid-body surfaces to us,
# so the whole object is retried too, with jittered backoff.
OBJECT_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class RemoteObject:
    key: str
    size: int
    etag: str
    #: Versioned listings only: the version to GET, and whether the key was a
    #: directory marker ``a/`` (obstore's listing cannot tell; see sync._settle_empties).
    version_id: str | None = None
    marker: bool = False


def remote_objects(batch: list[Listed]) -> list[RemoteObject]:
    """A listing page from either client (store.py) as the copy's objects."""
    return [RemoteObject(key, size, etag) for key, size, etag in batch]


class UnrepresentableKeys(Exception):
    """obstore met a key it cannot represent; see listing.list_keys_raw."""


class ObjectGone(Exception):
    """The object was deleted after it was listed (obstore raises a bare FileNotFoundError)."""


@dataclass(slots=True)
class Fetched:
    size: int
    etag: str

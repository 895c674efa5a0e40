"""What one ``sync`` run is asked to do (no asyncio, no data plane: imported on the warm path)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dscache_contract import Selection

from .source import S3Source

#: Requests in flight by default, whatever the CPUs: s5cmd's default too.
DEFAULT_CONCURRENCY = 256
#: Small objects' bodies held in memory at once (the native plane, native.py):
#: what bounds the stager's buffers, not the request count.
BUFFER_BYTES = 64 << 20


def default_concurrency() -> int:
    # Small objects are latency-bound: at a 20 ms round trip, 64 requests in
    # flight carry at most 3,200 objects/s however many cores copy them, and
    # 2,000 objects waited ~31 round trips. A request in flight costs a
    # connection and no CPU, so the count is not tied to the CPUs any more;
    # memory is bounded by bytes instead (BUFFER_BYTES: 256 x 64 KiB objects
    # are 16 MiB, and 1 MiB objects stop at 64 in flight).
    return DEFAULT_CONCURRENCY


@dataclass
class SyncOptions:
    source: S3Source
    cache_dir: str
    revision: str
    #: Versioned bucket: the revision's versions time (dscache_contract.versions).
    as_of: str | None = None
    pod_uid: str | None = None
    #: --include/--exclude: globs on the key relative to the prefix (dscache_contract.Selection).
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    concurrency: int = field(default_factory=default_concurrency)
    progress_interval: float = 3.0
    #: The node agent to ask for room, this copy's cache (NAMESPACE/NAME) and its revision's size.
    agent: str | None = None
    cache: str | None = None
    bytes: int | None = None
    #: The cache's peer token (a file: the kubelet refreshes a rotated Secret): with the agent,
    #: objects come from other nodes where they can (peers.py).
    peer_token_file: str | None = None
    #: A pre-stage pod's copy: the agent evicts no pre-staged copy and none in use for it.
    prestage: bool = False
    #: The pod starts with pods on other nodes (--cohort): with peers, a node that sees no other node
    #: yet waits peer_listing.SETTLE_S before it lists the bucket, so a gang lists it once.
    cohort: bool = False

    @property
    def selection(self) -> Selection:
        return Selection(self.source.prefix, self.include, self.exclude)

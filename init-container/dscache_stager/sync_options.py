"""What one ``sync`` run is asked to do (no asyncio, no data plane: imported on the warm path)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dscache_contract import Selection

from .cpus import available_cpus
from .keys import Filters
from .source import S3Source


def default_concurrency() -> int:
    # Requests in flight. Small objects are latency-bound (real S3 answers in
    # tens of ms), so many more than cores; memory stays under this x 1 MiB.
    # The CPUs are the container's (its cgroup quota), not the node's count.
    return min(256, max(64, 32 * available_cpus()))


@dataclass
class SyncOptions:
    source: S3Source
    cache_dir: str
    revision: str
    #: Versioned bucket: the revision's versions time (dscache_contract.versions).
    as_of: str | None = None
    pod_uid: str | None = None
    filters: Filters = field(default_factory=Filters)
    concurrency: int = field(default_factory=default_concurrency)
    progress_interval: float = 3.0
    #: The node agent to ask for room, this copy's cache (NAMESPACE/NAME) and its revision's size.
    agent: str | None = None
    cache: str | None = None
    bytes: int | None = None
    #: The cache's peer token (a file: the kubelet refreshes a rotated Secret): with the agent,
    #: objects come from other nodes where they can (peers.py).
    peer_token_file: str | None = None

    @property
    def selection(self) -> Selection:
        return Selection(self.source.prefix, tuple(self.filters.include), tuple(self.filters.exclude))

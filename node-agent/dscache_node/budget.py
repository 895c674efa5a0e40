"""The node's byte budget: how much room a new copy has, and which copies make more (pure).

Two limits hold at once: all copies together stay within the budget, and the
filesystem keeps the headroom free (cacheRoot may share its disk with other
things, and the kubelet evicts pods once the disk is nearly full). Room is
made by evicting complete copies that no lease holds, least recently
released first; a copy with a lease is never a candidate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .disk import OnDisk


@dataclass(frozen=True)
class Room:
    budget: int
    #: bytes held by every copy (complete ones by their summary, others by their reservation)
    held: int
    #: bytes the filesystem can still take before it reaches the headroom
    fs_room: int

    @property
    def available(self) -> int:
        return max(0, min(self.budget - self.held, self.fs_room))


def room(
    budget: int, fs_free: int, headroom: int, revisions: Iterable[OnDisk], reserved: int, reserved_fs: int
) -> Room:
    """``reserved``: bytes promised to copies in progress (not yet complete), counted against the
    budget; ``reserved_fs``: the part of those counted against the filesystem's free space."""
    held = sum(r.held for r in revisions if r.complete) + reserved
    return Room(budget, held, fs_free - headroom - reserved_fs)


def evictable(revisions: Iterable[OnDisk], keep: frozenset[tuple[str, str]] = frozenset()) -> list[OnDisk]:
    """Complete copies no lease holds, oldest release first; ``keep``: (namespace, cache) whose
    copies must stay (the cache being staged right now holds its own lock)."""
    out = [r for r in revisions if r.complete and not r.leases and r.cache_dir not in keep]
    return sorted(out, key=lambda r: (r.released_at, r.namespace, r.cache, r.revision))


def fits(need: int, current: Room, need_fs: int | None = None) -> bool:
    """Whether ``need`` bytes fit the budget and ``need_fs`` (default: ``need``) the filesystem: a
    copy resumed after an interruption has part of its bytes on the disk already."""
    return current.budget - current.held >= need and current.fs_room >= (need if need_fs is None else need_fs)


def victims(need: int, current: Room, candidates: list[OnDisk], need_fs: int | None = None) -> list[OnDisk] | None:
    """The shortest LRU prefix of ``candidates`` whose eviction makes ``need`` (``need_fs`` on the
    filesystem) fit; None if even all of them would not."""
    chosen: list[OnDisk] = []
    held, fs_room = current.held, current.fs_room
    for r in [None, *candidates]:
        if r is not None:
            chosen.append(r)
            held -= r.held
            fs_room += r.held
        if fits(need, Room(current.budget, held, fs_room), need_fs):
            return chosen
    return None

"""Progress lines on stderr: plain lines every few seconds, fine for non-TTY logs."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from dscache_contract import human_bytes


@dataclass
class Progress:
    out: TextIO = field(default_factory=lambda: sys.stderr)
    started: float = field(default_factory=time.monotonic)
    listing_done: bool = False
    to_fetch_objects: int = 0
    to_fetch_bytes: int = 0
    fetched_objects: int = 0
    fetched_bytes: int = 0
    skipped: int = 0
    #: Of fetched_bytes, those taken from other nodes (fetch once per cluster).
    peer_bytes: int = 0

    def add_bytes(self, n: int) -> None:
        self.fetched_bytes += n

    def note(self, message: str) -> None:
        print(f"dscache-stage: {message}", file=self.out, flush=True)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = self.fetched_bytes / elapsed
        more = "" if self.listing_done else "+"
        text = (
            f"{self.fetched_objects}/{self.to_fetch_objects}{more} objects, "
            f"{human_bytes(self.fetched_bytes)}/{human_bytes(self.to_fetch_bytes)}{more}, "
            f"{rate / 1e6:.1f} MB/s"
        )
        if self.peer_bytes:
            text += f", {human_bytes(self.peer_bytes)} from peers"
        if self.skipped:
            text += f", {self.skipped} already present"
        if self.listing_done and rate > 0:
            text += f", ETA {max(self.to_fetch_bytes - self.fetched_bytes, 0) / rate:.0f}s"
        elif not self.listing_done:
            text += ", listing"
        return text

    def report(self) -> None:
        self.note(self.line())

"""Removing trees off the agent's lock: a copy is renamed out of the way under the lock (fast,
layout.discard), and the tree is removed here, on a thread of its own.

A removal of a large tree (a million files) takes seconds to minutes; held under the
agent's lock it kept every reservation, every peers question and every wipe waiting.
Until a tree is gone its blocks are still in use: ``pending`` says how many of them
are on their way out, for the filesystem check of a reservation made meanwhile.
"""

from __future__ import annotations

import logging
import queue
import threading

from dscache_stager.layout import remove_tree

from . import disk

log = logging.getLogger("dscache-node")


class Remover:
    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, int]] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None

    def remove(self, path: str, nbytes: int = -1) -> None:
        """Remove ``path`` (already renamed out of every reader's way) soon; ``nbytes``: what it
        takes on the disk (-1: measure it)."""
        with self._lock:
            if path in self._pending:
                return
            self._pending[path] = disk.usage(path) if nbytes < 0 else nbytes
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="remover", daemon=True)
                self._thread.start()
        self._queue.put((path, 0))

    def pending(self) -> int:
        """Bytes on their way out (still taken on the disk)."""
        with self._lock:
            return sum(self._pending.values())

    def queued(self) -> set[str]:
        with self._lock:
            return set(self._pending)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is left to remove (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

    def _run(self) -> None:
        while True:
            path, _ = self._queue.get()
            try:
                remove_tree(path)
            except Exception as e:  # the next pass finds the .gone- entry and queues it again
                log.warning(f"could not remove {path}: {e}")
            with self._idle:
                self._pending.pop(path, None)
                self._idle.notify_all()

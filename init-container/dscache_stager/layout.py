"""The on-disk layout of a staged copy, and the records kept beside the data.

    DEST/<rel path>              the data
    DEST/.dscache/lock           flock() target: one stager at a time per DEST
    DEST/.dscache/tmp/           downloads in flight (never under a final name)
    DEST/.dscache/journal.jsonl  objects placed so far by an unfinished run
    DEST/.dscache/manifest.jsonl every object of the last complete run
    DEST/.dscache/complete       written last; its presence means DEST is whole
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .errors import DestinationError
from .keys import RESERVED_TOP


@dataclass(frozen=True, slots=True)
class Entry:
    """One object as recorded in the manifest."""

    key: str
    rel: str
    size: int
    etag: str

    def to_json(self) -> str:
        return json.dumps({"key": self.key, "path": self.rel, "size": self.size, "etag": self.etag})


class Layout:
    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.meta = dest / RESERVED_TOP
        self.tmp = self.meta / "tmp"
        self.lock_path = self.meta / "lock"
        self.journal_path = self.meta / "journal.jsonl"
        self.manifest_path = self.meta / "manifest.jsonl"
        self.complete_path = self.meta / "complete"

    def prepare(self) -> None:
        self.meta.mkdir(parents=True, exist_ok=True)
        os.chmod(self.meta, 0o755)
        try:
            os.chmod(self.dest, 0o755)  # training containers may run as any uid
        except PermissionError:
            pass  # not ours (a kubelet-made emptyDir, mode 0777): leave it as it is

    @contextmanager
    def locked(self, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """Hold an exclusive kernel lock on DEST for the duration.

        flock() dies with its holder, so a killed stager never leaves a stale
        lock behind. A wipe deletes DEST while holding the lock; a stager that
        waited through it finds its lock file unlinked and starts over.
        """
        while True:
            try:
                self.prepare()
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise DestinationError(f"cannot create {self.dest}: {e.strerror}; "
                                       f"check the cache volume and its permissions") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait:
                    on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _still_linked(fd, self.lock_path):
                break
            os.close(fd)
        try:
            yield
        finally:
            os.close(fd)

    def clear_tmp(self) -> None:
        """Drop leftovers of a killed run; they were never visible as data."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(mode=0o755)

    # --- completion -------------------------------------------------------

    def completed_at(self) -> float | None:
        try:
            return os.stat(self.complete_path).st_mtime
        except FileNotFoundError:
            return None

    def read_complete(self) -> dict | None:
        try:
            return json.loads(self.complete_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def mark_incomplete(self) -> None:
        self.complete_path.unlink(missing_ok=True)

    def mark_complete(self, entries: Iterable[Entry], summary: dict) -> None:
        """Write the manifest, then the marker, each atomically.

        Nothing is fsynced: the training container should start the moment
        the bytes are in the page cache. Durability across a crash comes from
        :meth:`known_entries` instead, which distrusts records older than
        the last boot.
        """
        write_atomic(self.manifest_path, "".join(e.to_json() + "\n" for e in entries), self.tmp)
        write_atomic(self.complete_path, json.dumps(summary) + "\n", self.tmp)
        self.journal_path.unlink(missing_ok=True)

    # --- what an earlier run already placed -------------------------------

    def known_entries(self) -> dict[str, Entry]:
        """Objects an earlier run placed: the manifest, then its unfinished journal.

        Records written before the node last booted are ignored: their data
        may never have reached the disk, so those files are fetched again.
        """
        known: dict[str, Entry] = {}
        booted = boot_time()
        for path in (self.manifest_path, self.journal_path):
            try:
                if os.stat(path).st_mtime < booted:
                    continue
            except FileNotFoundError:
                continue
            for entry in read_entries(path):
                known[entry.rel] = entry
        return known

    def open_journal(self) -> IO[str]:
        return open(self.journal_path, "a", buffering=1 << 16)


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def boot_time() -> float:
    """When this node booted, in epoch seconds (0 if unknown)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def read_entries(path: Path) -> Iterator[Entry]:
    try:
        f = open(path)
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                d = json.loads(line)
                yield Entry(d["key"], d["path"], int(d["size"]), d["etag"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line from a killed run


def write_atomic(path: Path, text: str, tmp_dir: Path) -> None:
    tmp = tmp_dir / f".{path.name}.{os.getpid()}.{time.monotonic_ns()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.rename(tmp, path)

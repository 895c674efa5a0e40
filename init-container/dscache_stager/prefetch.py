"""Read the data plane's shared objects ahead of their import (issue 30: the fixed cost).

A stager starts with its image's files cold more often than not: a new node,
or a node whose page cache other pods have since filled (bench/stager.py drops
the cache before every run for the same reason). Then a copy's fixed cost is
mostly the disk, not the CPU: measured on the bench's machine, one 1 KiB copy
read ~37 MB (``/usr/bin/time`` %I) where s5cmd reads 18, over 40% of it the two
Rust extensions (obstore's 15 MB shared object, dscache_native's 5.6 MB). The
dynamic loader pages those in as it relocates and runs them: page faults one
after another, each a small read the import waits on.

``start()`` asks the kernel for all of both files at once (posix_fadvise
WILLNEED: large sequential reads, queued together) from a daemon thread, the
first thing the command line does; the interpreter meanwhile imports its
pure-Python modules, and by the time ``import obstore`` runs its pages are in
memory, or on their way. Nothing here is needed for correctness: a file that
is missing or cannot be opened is skipped, and the imports read what is left.
"""

from __future__ import annotations

import os
import sys
import threading

#: "0" turns the prefetch off (to measure what it saves).
ENV = "DSCACHE_PREFETCH"

#: The extensions' directories under site-packages and the names their shared objects start with.
EXTENSIONS = (("obstore", "_obstore"), ("dscache_native", "dscache_native"))


def shared_objects(paths: list[str] | None = None) -> list[str]:
    """The extensions' shared objects found on ``paths`` (sys.path), without importing them."""
    found: list[str] = []
    for package, stem in EXTENSIONS:
        for entry in sys.path if paths is None else paths:
            directory = os.path.join(entry or ".", package)
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            hits = [n for n in names if n.startswith(stem) and n.endswith(".so")]
            found += [os.path.join(directory, n) for n in sorted(hits)]
            if hits:
                break  # the first on sys.path is the one import takes
    return found


def advise(path: str) -> None:
    """Start reading all of ``path`` into the page cache; never raise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def start() -> threading.Thread | None:
    """Prefetch the shared objects on a daemon thread; None when there is nothing to read."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    files = shared_objects()
    if os.environ.get("DSCACHE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        files = [f for f in files if os.sep + "dscache_native" + os.sep not in f]  # native.load() will not
    if not files:
        return None

    def run() -> None:
        for f in files:
            advise(f)

    thread = threading.Thread(target=run, name="prefetch", daemon=True)
    thread.start()
    return thread

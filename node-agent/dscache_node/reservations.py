"""The agent's reservations for copies in progress, kept on the node's disk across restarts.

A reservation promises bytes of the budget to a copy that has not finished yet. Held
only in memory, an agent restart forgot them, and the next reservation could promise
the same bytes again. They live in ``<cacheRoot>/.dscache-node/reservations.json``
(a name no namespace can have, so no cache dir and no stager's mount reaches it),
rewritten atomically at each change; a reservation still goes once its copy is
complete, its stager lets go of the cache's lock, or RESERVATION_TTL passes.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

log = logging.getLogger("dscache-node")

STATE_DIR = ".dscache-node"
FILE = "reservations.json"
#: The copies pre-stage pods made (agent.reserve: no pre-stage evicts them), beside it.
PRESTAGED_FILE = "prestaged.json"

Key = tuple[str, str, str]


def path(root: str) -> str:
    return os.path.join(root, STATE_DIR, FILE)


def load(root: str) -> dict[Key, tuple[int, float]]:
    """(namespace, cache, revision) -> (bytes, when reserved: epoch seconds); {} if none or unreadable."""
    try:
        with open(path(root)) as f:
            rows = json.load(f)
        return {(str(r[0]), str(r[1]), str(r[2])): (int(r[3]), float(r[4])) for r in rows}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, IndexError) as e:
        log.warning(f"cannot read the reservations of copies in progress ({e}); starting without them")
        return {}


def save(root: str, reserved: dict[Key, tuple[int, float]]) -> None:
    rows = [[*k, b, at] for k, (b, at) in sorted(reserved.items())]
    _write(root, FILE, rows, "the reservations of copies in progress")


def load_prestaged(root: str) -> set[Key]:
    """The (namespace, cache, revision) of copies pre-stage pods made; empty if none or unreadable."""
    try:
        with open(os.path.join(root, STATE_DIR, PRESTAGED_FILE)) as f:
            return {(str(r[0]), str(r[1]), str(r[2])) for r in json.load(f)}
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, TypeError, IndexError) as e:
        log.warning(f"cannot read which copies are pre-staged ({e}); starting without them")
        return set()


def save_prestaged(root: str, keys: set[Key]) -> None:
    _write(root, PRESTAGED_FILE, [list(k) for k in sorted(keys)], "which copies are pre-staged")


def _write(root: str, name: str, rows: list[list[object]], what: str) -> None:
    """``rows`` as JSON in STATE_DIR/``name``, replaced atomically."""
    d = os.path.join(root, STATE_DIR)
    try:
        os.makedirs(d, 0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, os.path.join(d, name))
    except OSError as e:
        log.warning(f"cannot keep {what} on disk: {e}")

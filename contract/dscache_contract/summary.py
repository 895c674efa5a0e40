"""What the stager reports: exit codes, the success line, and the manifest records.

On success the stager prints one JSON line (StageSummary or WipeSummary) on
stdout and in the termination log; on failure one line ``error: <reason>``
and a non-zero ExitCode.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import IntEnum
from typing import Any, TypeVar


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1  # a bug: report it with the log
    USAGE = 2  # bad command line or source URI
    SOURCE = 3  # the bucket cannot be read with this pod's credentials
    NO_SPACE = 4  # the destination cannot hold the objects still to copy
    HOSTILE_KEYS = 5  # object keys that cannot be written safely
    DESTINATION = 6  # writing the destination failed
    TRANSIENT = 7  # S3 kept failing after every retry
    BUSY = 8  # wipe only: a stager holds the lock; nothing was done
    REVISION_GONE = 9  # the bucket can no longer serve the pinned revision
    CACHE_GONE = 10  # the cache dir (the pod's mount source) was removed
    INTERRUPTED = 130  # SIGINT


EXIT_CODE_HELP: dict[ExitCode, str] = {
    ExitCode.OK: "success",
    ExitCode.INTERNAL: "internal error (a bug: please report it with the log)",
    ExitCode.USAGE: "bad command line or source URI",
    ExitCode.SOURCE: "the bucket cannot be read: no such bucket, access denied, bad credentials, "
    "unreachable endpoint (checked on every run, warm or cold)",
    ExitCode.NO_SPACE: "the destination cannot hold the objects still to copy",
    ExitCode.HOSTILE_KEYS: "object keys that cannot be written safely under the destination",
    ExitCode.DESTINATION: "writing the destination failed: disk full, permissions, a read-only filesystem",
    ExitCode.TRANSIENT: "S3 kept failing (throttling, 5xx, dropped connections) after every retry",
    ExitCode.BUSY: "wipe only: a stager holds the cache's lock (with --legacy: or a version 1 stager "
    "ran there moments ago); nothing was done, retry later",
    ExitCode.REVISION_GONE: "the bucket no longer holds the revision the pod was admitted with "
    "(an object changed or was deleted); nothing was served",
    ExitCode.CACHE_GONE: "the cache dir on the node was removed after the pod started "
    "(its DatasetCache was deleted); recreate the pod",
    ExitCode.INTERRUPTED: "interrupted (SIGINT)",
}


def human_bytes(n: float) -> str:
    """A byte count as people read it (1.5 KiB, 3.0 GiB), in the stager's logs and the operator's status."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_T = TypeVar("_T")

#: The longest WipeSummary line (json.dumps escapes non-ASCII, so chars = bytes);
#: the CLI also cuts its termination log there.
WIPE_JSON_MAX = 4000


def _from_dict(cls: type[_T], d: dict[str, Any]) -> _T:
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]  # cls is one of the dataclasses below
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class StageSummary:
    """The success line of ``dscache-stage sync``.

    warm: the revision was already complete on the node (no listing, no copy).
    The first seven fields are the summary's historic ones; consumers must
    ignore fields they do not know. fetched_bytes = bucket_bytes + peer_bytes:
    what this run copied, from the bucket and from other nodes (fetch once per
    cluster); absent (older stagers): 0.
    """

    objects: int = 0
    bytes: int = 0
    skipped: int = 0
    fetched_bytes: int = 0
    deleted: int = 0
    seconds: float = 0.0
    mb_s: float = 0.0
    revision: str = ""
    warm: bool = False
    fetched_objects: int = 0
    bucket_bytes: int = 0
    peer_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds"] = round(self.seconds, 3)
        d["mb_s"] = round(self.fetched_bytes / 1e6 / self.seconds, 1) if self.seconds > 0 else 0.0
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_message(cls, message: str | None) -> StageSummary | None:
        """The summary in a stager's termination message (its last JSON line), typed;
        also what a revision's completion marker (meta/complete) holds.

        None when there is none: a failure's ``error: ...`` line, a message cut
        by the kubelet, or no message. Fields of the wrong type (a newer or a
        broken stager) take their defaults, so a reader never sees a str where
        an int belongs; unknown fields are ignored."""
        data = _last_json_object(message)
        if data is None:
            return None
        return cls(**{f.name: data[f.name] for f in fields(cls) if _fits(data.get(f.name), f.default)})


def _last_json_object(message: str | None) -> dict[str, Any] | None:
    for line in reversed((message or "").strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


def _fits(value: Any, default: Any) -> bool:
    """Whether ``value`` may stand where ``default`` is: same type, an int for a
    float, never a bool for a number (bool is an int subclass), never negative."""
    if value is None or isinstance(value, bool) != isinstance(default, bool):
        return False
    if isinstance(default, float):
        return isinstance(value, (int, float)) and value >= 0
    if isinstance(default, int) and not isinstance(default, bool):
        return isinstance(value, int) and value >= 0
    return isinstance(value, type(default))


@dataclass
class WipeSummary:
    """The success line of ``dscache-stage wipe``.

    removed: the revision dir (with --all, C; with --legacy, the version 1
    entries) was deleted this time; existed: it was there to delete.
    leases: the pod UIDs whose lease files are still present and kept it:
    plain UIDs, sorted, each once, in every mode (with --all, over every
    revision), so they can go back as --release as they are.
    stray: entries under C/leases that are no lease (a name that is no pod
    UID or no revision, a file where a revision's dir belongs), as paths
    relative to C/leases. They keep it too (what we cannot name we do not
    delete); a person has to look at them.
    legacy_entries: with --legacy, how many top-level entries were removed.
    truncated: leases and stray were cut to fit WIPE_JSON_MAX (see to_json).
    """

    cache: str = ""
    revision: str | None = None
    released: list[str] = field(default_factory=list)
    removed: bool = False
    existed: bool = False
    leases: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)
    legacy: bool = False
    legacy_entries: int = 0
    truncated: bool = False

    def to_json(self) -> str:
        """At most WIPE_JSON_MAX bytes: the kubelet keeps 4096 bytes of a termination
        message, and a line cut there is no JSON at all, which would read as "no
        summary". So with many leases the lists are cut instead (stray first: a
        person must see those), and ``truncated`` says so. The operator releases
        the finished pods among those it sees; later wipes report the rest."""
        d = asdict(self)
        text = json.dumps(d)
        if len(text) <= WIPE_JSON_MAX:
            return text
        d.update(truncated=True, leases=[], stray=[])
        room = WIPE_JSON_MAX - len(json.dumps(d))
        for key, items in (("stray", self.stray), ("leases", self.leases)):
            for item in items:
                cost = len(json.dumps(item)) + 2  # and ", "
                if cost > room:
                    break
                d[key].append(item)
                room -= cost
        return json.dumps(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WipeSummary:
        return _from_dict(cls, d)


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One line of meta/manifest.jsonl: the object, where it is under data/, size, ETag."""

    key: str
    path: str
    size: int
    etag: str
    version_id: str | None = None

    def to_json(self) -> str:
        d = {"key": self.key, "path": self.path, "size": self.size, "etag": self.etag}
        if self.version_id is not None:
            d["versionId"] = self.version_id
        return json.dumps(d)

    @classmethod
    def from_json(cls, line: str) -> ManifestEntry:
        d = json.loads(line)
        return cls(d["key"], d["path"], int(d["size"]), d["etag"], d.get("versionId"))

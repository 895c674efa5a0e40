"""Turn object keys into relative paths that are safe to create under DEST."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

# Linux NAME_MAX: one path component may not exceed this many bytes.
NAME_MAX = 255
# Our own bookkeeping lives here; no object may land in it.
RESERVED_TOP = ".dscache"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def unsafe_reason(rel: str) -> str | None:
    """Why ``rel`` (a key minus the prefix) cannot be a path under DEST, or None."""
    if not rel:
        return "empty name"
    if rel.startswith("/"):
        return "absolute path"
    if _CONTROL.search(rel):
        return "control character"
    parts = rel.split("/")
    for part in parts:
        if part == "":
            return "empty path segment"
        if part in (".", ".."):
            return f"'{part}' segment"
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            return f"segment longer than {NAME_MAX} bytes"
    if parts[0] == RESERVED_TOP:
        return f"reserved name '{RESERVED_TOP}'"
    return None


@dataclass
class Filters:
    """Include/exclude globs on the key relative to the prefix.

    A key is taken when it matches any include (or there are none) and no
    exclude. ``*`` also matches ``/``, as in ``aws s3 sync``.
    """

    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)

    def accepts(self, rel: str) -> bool:
        if self.include and not any(fnmatch.fnmatchcase(rel, g) for g in self.include):
            return False
        return not any(fnmatch.fnmatchcase(rel, g) for g in self.exclude)


class TreeShape:
    """Detects keys that would need one path to be both a file and a directory."""

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._dirs: set[str] = set()

    def clash(self, rel: str) -> str | None:
        """Record ``rel``; return the path it collides with, if any."""
        if rel in self._dirs:
            return rel + "/"
        parts = rel.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in self._files:
                return parent
        if rel in self._files:
            return rel
        self._files.add(rel)
        for i in range(1, len(parts)):
            self._dirs.add("/".join(parts[:i]))
        return None

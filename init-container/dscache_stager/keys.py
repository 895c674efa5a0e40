"""Turn object keys into relative paths that are safe to create under a revision's data dir."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from dscache_contract import selected

# Linux NAME_MAX: one path component may not exceed this many bytes.
NAME_MAX = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def unsafe_reason(rel: str) -> str | None:
    """Why ``rel`` (a key minus the prefix) cannot be a path under the data dir, or None.

    The data dir holds objects and nothing else (our bookkeeping lives in the
    revision's meta/ and tmp/ beside it), so no name is reserved.
    """
    if not rel:
        return "empty name"
    if rel.startswith("/"):
        return "absolute path"
    if _CONTROL.search(rel):
        return "control character"
    for part in rel.split("/"):
        if part == "":
            return "empty path segment"
        if part in (".", ".."):
            return f"'{part}' segment"
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            return f"segment longer than {NAME_MAX} bytes"
    return None


@dataclass
class Filters:
    """Include/exclude globs on the key relative to the prefix (the rule is dscache_contract.selected)."""

    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)

    def accepts(self, rel: str) -> bool:
        return selected(rel, self.include, self.exclude)


class TreeShape:
    """Detects keys that would need one path to be both a file and a directory."""

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._dirs: set[str] = set()

    def is_dir(self, rel: str) -> bool:
        return rel in self._dirs

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

"""Turn object keys into relative paths that are safe to create under a revision's data dir."""

from __future__ import annotations

import re

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


class TreeShape:
    """Detects keys that would need one path to be both a file and a directory.

    Fed in listing order (S3 lists keys in UTF-8 byte order, which is Python's
    str order), it holds the directories seen, which grow with the tree's
    directories and not its files, and only those files that are string
    prefixes of the latest key. A file ``f`` can clash only with a later key
    that starts with ``f + "/"``, and in sorted order every key between the two
    starts with ``f`` as well, so ``f`` can be dropped at the first key that
    does not: at a million keys this holds a few strings, where a set of every
    file held ~100 bytes per key.
    """

    def __init__(self) -> None:
        self._dirs: set[str] = set()
        self._open: list[str] = []  # files, each a string prefix of the next (and of the latest key)

    def is_dir(self, rel: str) -> bool:
        return rel in self._dirs

    def file_at_or_above(self, rel: str) -> str | None:
        """The recorded file that is ``rel`` itself or one of its parents, if any (records nothing)."""
        stack = self._open
        while stack and not rel.startswith(stack[-1]):
            stack.pop()  # no key from here on can start with it
        for f in stack:
            if len(rel) == len(f) or rel[len(f)] == "/":
                return f
        return None

    def add_parents(self, rel: str) -> None:
        """Record the directories above ``rel``."""
        parent = rel.rpartition("/")[0]
        while parent and parent not in self._dirs:
            self._dirs.add(parent)
            parent = parent.rpartition("/")[0]

    def clash(self, rel: str) -> str | None:
        """Record the file ``rel``; return the path it collides with, if any."""
        if rel in self._dirs:
            return rel + "/"
        if (f := self.file_at_or_above(rel)) is not None:
            return f
        self._open.append(rel)
        self.add_parents(rel)
        return None

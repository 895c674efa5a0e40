"""Operations on a revision's data dir that never step outside it.

The data dir belongs to the stager while the revision is incomplete, so
anything in the way of the bucket's shape (a stale file where a directory
must go, a symlink left by someone else) is removed rather than followed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator


class LocalTree:
    def __init__(self, dest: str) -> None:
        self.dest = dest
        self._dirs: set[str] = {""}

    @property
    def dirs(self) -> set[str]:
        """Relative dirs created or seen so far ("" is the data dir itself)."""
        return self._dirs

    def path(self, rel: str) -> str:
        return os.path.join(self.dest, rel)

    def ensure_parent(self, rel: str) -> None:
        """Create the directories above ``rel`` as real directories, never via symlinks."""
        parent = rel.rpartition("/")[0]
        if parent in self._dirs:
            return
        done = ""
        for part in parent.split("/"):
            done = f"{done}/{part}" if done else part
            if done in self._dirs:
                continue
            full = self.path(done)
            try:
                os.mkdir(full, 0o755)
            except FileExistsError:
                st = os.lstat(full)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(full)  # a stale file or a symlink: never follow it
                    os.mkdir(full, 0o755)
            self._dirs.add(done)

    def place(self, tmp: str, rel: str) -> None:
        """Atomically move a finished temp file to its final name."""
        final = self.path(rel)
        try:
            os.rename(tmp, final)
        except IsADirectoryError:
            # A stale directory where the bucket now has a file.
            import shutil  # here: it imports zlib, bz2 and lzma, which a cold start does without

            shutil.rmtree(final)
            os.rename(tmp, final)

    def is_current(self, rel: str, size: int) -> bool:
        """True if ``rel`` is a regular file (not a symlink) of ``size`` bytes."""
        try:
            st = os.lstat(self.path(rel))
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == size

    def walk_files(self) -> Iterator[str]:
        """Relative paths of every non-directory entry, without following symlinks."""
        stack = [""]
        while stack:
            rel_dir = stack.pop()
            with os.scandir(self.path(rel_dir) if rel_dir else self.dest) as it:
                for e in it:
                    rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
                    if e.is_dir(follow_symlinks=False):
                        self._dirs.add(rel)
                        stack.append(rel)
                    else:
                        yield rel

    def stale(self, keep: set[str]) -> list[str]:
        """Files under the data dir that are not in ``keep``."""
        return [rel for rel in self.walk_files() if rel not in keep]

    def remove(self, rels: list[str]) -> None:
        """Delete these files (symlinks themselves, never their targets), then directories left empty."""
        for rel in rels:
            os.unlink(self.path(rel))
        self._remove_empty_dirs()

    def _remove_empty_dirs(self) -> None:
        for root, _, _ in os.walk(self.dest, topdown=False, followlinks=False):
            rel = os.path.relpath(root, self.dest)
            if rel == ".":
                continue
            try:
                os.rmdir(root)  # only succeeds when empty
            except OSError:
                pass
            self._dirs.discard(rel)

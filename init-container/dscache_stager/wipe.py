"""Delete a staged copy, but only inside the cache root, never via symlinks."""

from __future__ import annotations

import fcntl
import os
import shutil
import stat

from .errors import BusyError, UsageError
from .keys import RESERVED_TOP


def wipe(directory: str, root: str) -> bool:
    """Remove ``directory`` if it lies strictly inside ``root``. Returns False if already gone.

    Both paths are resolved lexically and through the real filesystem: a
    ``directory`` that is, or passes through, a symlink is refused, so a
    link planted inside the cache cannot redirect the delete elsewhere.
    ``shutil.rmtree`` itself never follows symlinks (it unlinks them).
    """
    if not os.path.isabs(directory) or not os.path.isabs(root):
        raise UsageError(f"wipe needs absolute paths, got DIR={directory!r} ROOT={root!r}")
    root_norm, target = os.path.normpath(root), os.path.normpath(directory)
    if os.path.commonpath([root_norm, target]) != root_norm or target == root_norm:
        raise UsageError(f"refusing to wipe {directory!r}: it is not inside the cache root {root!r}")
    # The root may itself be a symlink the admin chose; below it, every
    # component must be a real directory.
    current = os.path.realpath(root_norm)
    rel_parts = os.path.relpath(target, root_norm).split(os.sep)
    for part in rel_parts:
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            raise UsageError(f"refusing to wipe {directory!r}: {current!r} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(current)
        return True
    lock = _try_lock(current)
    try:
        shutil.rmtree(current)
    finally:
        if lock is not None:
            os.close(lock)
    return True


def _try_lock(directory: str) -> int | None:
    """Take the stagers' lock on a copy, or refuse: never delete data being staged.

    A stager that was waiting on this lock finds its lock file unlinked once
    we release it, and starts over in a fresh directory (layout.Layout.locked).
    """
    try:
        fd = os.open(os.path.join(directory, RESERVED_TOP, "lock"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None  # never staged, or not by us: nothing to coordinate with
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BusyError(f"{directory} is being staged by a running stager; not wiped, retry once it is done")
    return fd

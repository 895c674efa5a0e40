"""Bind mounts: the only place the agent changes the node's mount table.

mount(2) and umount2(2) through libc (no ``mount`` binary in the image), and the mount
table read from /proc/self/mountinfo. The agent mounts the kubelet's directory with
Bidirectional propagation, so a bind mount made here is the one the kubelet hands to the
pod's containers, and it outlives the agent's own container.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Protocol

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MNT_DETACH = 2


class Mounter(Protocol):
    """What the publisher needs of the mount table (a fake one in unit tests)."""

    def bind(self, source: str, target: str, readonly: bool) -> None: ...

    def unmount(self, target: str) -> None: ...

    def is_mount(self, target: str) -> bool: ...


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> set[str]:
    """Every mount point in this process's mount namespace."""
    with open(mountinfo) as f:
        return {_unescape(line.split(" ", 5)[4]) for line in f if line.count(" ") >= 5}


class LibcMounter:
    """The real mount table, through libc."""

    def __init__(self, mountinfo: str = "/proc/self/mountinfo") -> None:
        self.mountinfo = mountinfo
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
        self._libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

    def _mount(self, source: str, target: str, flags: int) -> None:
        if self._libc.mount(source.encode(), target.encode(), None, flags, None) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mount {source} on {target}: {os.strerror(e)}")

    def bind(self, source: str, target: str, readonly: bool) -> None:
        self._mount(source, target, MS_BIND)
        if readonly:
            try:
                self._mount(source, target, MS_BIND | MS_REMOUNT | MS_RDONLY)
            except OSError:
                self.unmount(target)
                raise

    def unmount(self, target: str) -> None:
        if self._libc.umount2(target.encode(), 0) != 0:
            e = ctypes.get_errno()
            if e == errno.EINVAL and not self.is_mount(target):
                return  # not mounted (any more): nothing to undo
            raise OSError(e, f"unmount {target}: {os.strerror(e)}")

    def is_mount(self, target: str) -> bool:
        return os.path.normpath(target) in mount_points(self.mountinfo)

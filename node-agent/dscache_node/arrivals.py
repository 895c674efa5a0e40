"""Wake-ups for the object requests a peer holds here while this node's stager copies the object
(issue 30): inotify on the directories they wait in, so a held request wakes once, when its file
(or a directory on its way) is placed, instead of looking every POLL_S.

Held requests were a tenth of the agent's CPU at N = 16: each looked for its file every 50 ms
(an openat per path component), most of them for nothing. Here a request says which name it
waits for in the deepest directory that exists on its way (peers.RevisionDirs.nearest, reached
beneath C without a symlink); the directory is watched through its open descriptor
(``/proc/self/fd/<n>``: the directory itself, whatever its path names now) for names created
or renamed into it (the stager links or renames every object into place, whole, and makes
directories: a file written in place under its final name would be served as soon as its name
appears, as a poll could serve it, only sooner). A wake-up only says "look again": the request opens its object as ever, beneath C,
never through a symlink. Without inotify (no room for another instance: the kernel's per-user
bound, shared with the node's other programs), ``expect`` says so and the request polls.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import struct
from collections.abc import Callable

log = logging.getLogger("dscache-node")

IN_CREATE = 0x00000100
IN_MOVED_TO = 0x00000080
IN_ONLYDIR = 0x01000000
IN_IGNORED = 0x00008000
IN_Q_OVERFLOW = 0x00004000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name, NUL padded)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


class Arrivals:
    """The held requests' wake-ups on one event loop (its thread only)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._libc = _libc()
        self.fd = -1
        if self._libc is not None:
            self.fd = int(self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC))
            if self.fd < 0:
                log.info(f"no inotify ({os.strerror(ctypes.get_errno())}): held object requests poll")
        if self.fd >= 0:
            loop.add_reader(self.fd, self._read)
        #: watch -> name -> the futures of the requests waiting for that name there
        self._waiting: dict[int, dict[str, set[asyncio.Future[None]]]] = {}

    @property
    def working(self) -> bool:
        return self.fd >= 0

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
        self._wake_all()

    def expect(self, dir_fd: int, name: str) -> tuple[asyncio.Future[None], Callable[[], None]] | None:
        """A future done when ``name`` is created or renamed into the open directory ``dir_fd`` (or
        the directory goes, or events were lost), and the call that stops waiting; None when it
        cannot be watched (then poll). ``dir_fd`` stays the caller's."""
        if self.fd < 0 or self._libc is None:
            return None
        wd = int(
            self._libc.inotify_add_watch(
                self.fd, os.fsencode(f"/proc/self/fd/{dir_fd}"), IN_CREATE | IN_MOVED_TO | IN_ONLYDIR
            )
        )
        if wd < 0:
            return None
        fut: asyncio.Future[None] = self.loop.create_future()
        names = self._waiting.setdefault(wd, {})
        names.setdefault(name, set()).add(fut)

        def done() -> None:
            waiting = self._waiting.get(wd)
            if waiting is None:
                return
            futs = waiting.get(name)
            if futs is not None:
                futs.discard(fut)
                if not futs:
                    del waiting[name]
            if not waiting:
                del self._waiting[wd]
                if self.fd >= 0 and self._libc is not None:
                    self._libc.inotify_rm_watch(self.fd, wd)  # its IN_IGNORED finds nobody

        return fut, done

    def _read(self) -> None:
        try:
            buf = os.read(self.fd, 64 << 10)
        except BlockingIOError:
            return
        except OSError as e:
            log.warning(f"inotify read failed ({e}): held object requests poll from now on")
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
            self._wake_all()
            return
        at = 0
        while at + _EVENT.size <= len(buf):
            wd, mask, _, size = _EVENT.unpack_from(buf, at)
            name = os.fsdecode(buf[at + _EVENT.size : at + _EVENT.size + size].rstrip(b"\0"))
            at += _EVENT.size + size
            if mask & IN_Q_OVERFLOW:
                self._wake_all()  # events were lost: everyone looks again
                continue
            waiting = self._waiting.get(wd)
            if waiting is None:
                continue
            if mask & IN_IGNORED:  # the directory went (or its watch was removed): look again
                for futs in self._waiting.pop(wd).values():
                    _wake(futs)
                continue
            wanted = waiting.get(name)
            if wanted:
                _wake(wanted)

    def _wake_all(self) -> None:
        for waiting in self._waiting.values():
            for futs in waiting.values():
                _wake(futs)
        self._waiting.clear()


def _wake(futs: set[asyncio.Future[None]]) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_result(None)

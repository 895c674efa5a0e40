"""Zero-copy ranged GETs for plain-HTTP endpoints, with splice(2).

In-cluster object stores (MinIO, Ceph RGW) are often plain HTTP. For them a
large object's bytes can go socket -> pipe -> page cache without ever being
copied into user space. Measured on this 2-core VM, 2 x 256 MiB from a
loopback versitygw: obstore streaming 1.24-1.44 s at 0.8 s CPU; splice
0.51-0.66 s at 0.25 s CPU; s5cmd 0.47-0.72 s. HTTPS endpoints (AWS S3) keep
the obstore path: TLS must be decrypted in user space anyway.

The request is a presigned URL (signed by obstore with the store's own
credentials), so this module never sees a secret.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from urllib.parse import urlsplit

F_SETPIPE_SZ = 1031
PIPE_SIZE = 1 << 20
HEAD_LIMIT = 64 << 10


class HttpStatus(Exception):
    """The server answered with something other than the 206 we asked for."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status


class PeerError(Exception):
    """The connection failed or ended early (reset, timeout, short body)."""


def available() -> bool:
    return hasattr(os, "splice")


def get_range_into(url: str, start: int, end: int, fd: int, etag: str | None, timeout: float = 60.0) -> None:
    """Write bytes [start, end) of ``url`` into ``fd`` at the same offsets.

    Raises HttpStatus for a non-206 answer, PeerError for connection
    trouble, and OSError for trouble writing ``fd`` (ENOSPC...).
    """
    u = urlsplit(url)
    try:
        sock = socket.create_connection((u.hostname, u.port or 80), timeout=timeout)
    except OSError as e:
        raise PeerError(f"connect to {u.netloc}: {e}") from e
    with sock:
        lines = [
            f"GET {u.path}?{u.query} HTTP/1.1",
            f"Host: {u.netloc}",
            f"Range: bytes={start}-{end - 1}",
            "Connection: close",
        ]
        if etag:
            lines.append(f'If-Match: "{etag}"')
        try:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            head, body = _read_head(sock)
        except OSError as e:
            raise PeerError(f"request to {u.netloc}: {e}") from e
        status, headers = _parse_head(head)
        if status != 206:
            raise HttpStatus(status, (body[:300] or head[:300]).decode("latin-1", "replace"))
        if (
            headers.get("transfer-encoding", "identity") != "identity"
            or int(headers.get("content-length", -1)) != end - start
        ):
            raise HttpStatus(
                status,
                f"unexpected framing {headers.get('transfer-encoding')} "
                f"{headers.get('content-length')} for {end - start} bytes",
            )
        offset = start
        if body:
            os.pwrite(fd, body, offset)
            offset += len(body)
        # splice honours SO_RCVTIMEO on a blocking socket; Python's timeout
        # would make the fd non-blocking instead.
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(timeout), 0))
        _splice_body(sock.fileno(), fd, offset, end)


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(16384)
        if not chunk or len(buf) > HEAD_LIMIT:
            raise PeerError("connection closed before the response head")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    return head, body


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    first, *rest = head.decode("latin-1").split("\r\n")
    try:
        status = int(first.split(" ", 2)[1])
    except (IndexError, ValueError) as e:
        raise PeerError(f"bad status line {first!r}") from e
    headers = {}
    for line in rest:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    return status, headers


def _splice_body(src: int, dst: int, offset: int, end: int) -> None:
    r, w = os.pipe()
    try:
        try:
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass  # above /proc/sys/fs/pipe-max-size: the default 64 KiB works too
        while offset < end:
            try:
                n = os.splice(src, w, min(PIPE_SIZE, end - offset))
            except OSError as e:
                raise PeerError(f"reading the body: {e}") from e
            if n == 0:
                raise PeerError(f"connection closed {end - offset} bytes early")
            while n:
                m = os.splice(r, dst, n, offset_dst=offset)
                offset += m
                n -= m
    finally:
        os.close(r)
        os.close(w)

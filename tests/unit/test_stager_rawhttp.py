"""The zero-copy ranged GET against a scripted HTTP peer: every way it can go wrong."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from dscache_stager import rawhttp


def serve_once(response: bytes, cut_after: int | None = None) -> tuple[str, list[bytes]]:
    """A one-shot HTTP peer; returns its URL and the list that receives the request."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(4096)
            served.append(buf)
            conn.sendall(response if cut_after is None else response[:cut_after])
        srv.close()

    served: list[bytes] = []
    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{port}/bucket/key?X-Amz-Signature=abc", served


def partial(body: bytes, status: str = "206 Partial Content", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@pytest.fixture
def fd(tmp_path: Path):
    f = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    yield f
    os.close(f)


def test_writes_the_range_at_its_offset_and_sends_range_and_if_match(fd: int):
    body = os.urandom(3 << 20)
    url, served = serve_once(partial(body))
    rawhttp.get_range_into(url, 100, 100 + len(body), fd, "etag1", timeout=5)
    assert os.pread(fd, len(body), 100) == body
    req = served[0].decode()
    assert req.startswith("GET /bucket/key?X-Amz-Signature=abc HTTP/1.1")
    assert f"Range: bytes=100-{99 + len(body)}" in req and 'If-Match: "etag1"' in req


@pytest.mark.parametrize(
    "response, status",
    [
        (partial(b"<Error><Code>SlowDown</Code></Error>", "503 Slow Down"), 503),
        (partial(b"whole object", "200 OK"), 200),  # server ignored Range: never trust offsets
        (partial(b"", "412 Precondition Failed"), 412),
        (partial(b"abc", extra="Transfer-Encoding: chunked\r\n"), 206),
    ],
)
def test_anything_but_the_exact_206_is_refused(fd: int, response: bytes, status: int):
    url, _ = serve_once(response)
    with pytest.raises(rawhttp.HttpStatus) as e:
        rawhttp.get_range_into(url, 0, 12, fd, None, timeout=5)
    assert e.value.status == status


def test_a_body_cut_short_is_a_peer_error(fd: int):
    body = os.urandom(1 << 20)
    url, _ = serve_once(partial(body), cut_after=1000 + 300_000)
    with pytest.raises(rawhttp.PeerError, match="early"):
        rawhttp.get_range_into(url, 0, len(body), fd, None, timeout=5)


def test_connection_refused_is_a_peer_error(fd: int):
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(rawhttp.PeerError, match="connect"):
        rawhttp.get_range_into(f"http://127.0.0.1:{port}/b/k?x", 0, 10, fd, None, timeout=5)

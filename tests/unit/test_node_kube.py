"""The agent's API client keeps its TLS connections alive (issue 30: a handshake per call cost more
CPU than the calls), and a kept connection the server dropped costs a retry, never a failure."""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dscache_node.kube import ApiError, Kube
from tests.support.tlscerts import agent_certs


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, certs: tuple[Path, Path, Path]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(certs[1]), str(certs[2]))
        self.socket = ctx.wrap_socket(self.socket, server_side=True)
        self.connections = 0
        self.requests: list[tuple[str, str]] = []
        #: what the next responses do: "keep", "close" (says Connection: close), "drop" (closes
        #: the connection after the response without saying so, as an idle timeout would)
        self.mode = "keep"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, *_: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        self.server.requests.append((self.command, body))
        status = 404 if self.path.startswith("/missing") else 500 if self.path.startswith("/broken") else 200
        out = json.dumps({"path": self.path}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        if self.server.mode == "close":
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(out)
        if self.server.mode == "drop":
            self.close_connection = True

    do_GET = do_PATCH = do_POST = _answer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    s = _Server(agent_certs(tmp_path / "certs"))
    t = threading.Thread(target=s.serve_forever, daemon=True)
    t.start()
    yield s
    s.shutdown()
    s.server_close()


def _kube(s: _Server) -> Kube:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return Kube(f"https://127.0.0.1:{s.server_address[1]}", ctx, None, timeout=5)


def test_calls_share_one_connection(server: _Server) -> None:
    kube = _kube(server)
    assert kube.get("/a") == {"path": "/a"}
    assert kube.merge_patch("/b", {"x": 1}) == {"path": "/b"}
    assert kube.get("/missing") is None  # a 404 is an answer: the connection stays
    assert kube.post("/c", {"y": 2}) == {"path": "/c"}
    assert server.connections == 1
    assert server.requests == [("GET", ""), ("PATCH", '{"x": 1}'), ("GET", ""), ("POST", '{"y": 2}')]


def test_an_error_status_raises_and_the_connection_stays(server: _Server) -> None:
    kube = _kube(server)
    with pytest.raises(ApiError) as e:
        kube.get("/broken")
    assert e.value.status == 500
    assert kube.get("/a") == {"path": "/a"}
    assert server.connections == 1


def test_connection_close_is_honoured(server: _Server) -> None:
    server.mode = "close"
    kube = _kube(server)
    kube.get("/a")
    kube.get("/b")
    assert server.connections == 2


def test_a_dropped_idle_connection_is_replaced_and_the_call_sent_once_more(server: _Server) -> None:
    server.mode = "drop"
    kube = _kube(server)
    assert kube.get("/a") == {"path": "/a"}
    # The server closed the kept connection: the next call finds it dead and opens another.
    assert kube.merge_patch("/b", {"x": 1}) == {"path": "/b"}
    assert server.connections == 2
    assert server.requests == [("GET", ""), ("PATCH", '{"x": 1}')]  # each reached the server once


def test_a_new_connection_that_fails_is_not_retried(server: _Server) -> None:
    kube = _kube(server)
    server.shutdown()
    server.server_close()
    with pytest.raises(OSError):
        kube.get("/a")

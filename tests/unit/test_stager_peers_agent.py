"""The stager asks its agent who its peers are on one kept-alive connection (issue 30: it asks
five times a second, then every second), and opens it anew when the agent closed it."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dscache_contract.peers import PEERS_PATH, Peer, PeersAnswer, PeersRequest
from dscache_stager import agentcall
from dscache_stager.peers import Peers

REV = "r-0123456789abcdef0123"
ANSWER = PeersAnswer("10.0.0.1:9478", [Peer("10.0.0.1:9478", 1.0), Peer("10.0.0.2:9478", 2.0)])


class _Agent(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.asked: list[tuple[str, str, str]] = []  # path, token, revision
        self.mode = "keep"  # "drop": close after each answer without saying so; "refuse": 409
        self.delay = 0.0  # seconds before each answer (a loaded agent)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Agent

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, *_: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        req = PeersRequest.from_json(body)
        self.server.asked.append((self.path, self.headers.get("Authorization", ""), req.revision))
        time.sleep(self.server.delay)
        status, out = (409, b"no copy here") if self.server.mode == "refuse" else (200, ANSWER.to_json().encode())
        self.send_response(status)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
        if self.server.mode == "drop":
            self.close_connection = True


@pytest.fixture
def agent() -> Iterator[_Agent]:
    a = _Agent()
    threading.Thread(target=a.serve_forever, daemon=True).start()
    yield a
    a.shutdown()
    a.server_close()


def _peers(agent: _Agent, tmp_path: Path) -> Peers:
    tok = tmp_path / "token"
    tok.write_text("tok-1\n")
    return Peers(f"http://127.0.0.1:{agent.server_address[1]}", "ml/imagenet", REV, str(tok))


def test_questions_share_one_connection(agent: _Agent, tmp_path: Path) -> None:
    peers = _peers(agent, tmp_path)
    for _ in range(5):
        assert peers.ask_agent() == ANSWER
    assert agent.connections == 1
    assert agent.asked == [(PEERS_PATH, "Bearer tok-1", REV)] * 5


def test_a_connection_the_agent_closed_is_opened_anew(agent: _Agent, tmp_path: Path) -> None:
    agent.mode = "drop"
    peers = _peers(agent, tmp_path)
    for _ in range(3):
        assert peers.ask_agent() == ANSWER
    assert agent.connections == 3
    assert len(agent.asked) == 3  # each question reached the agent once


def test_a_refusal_is_no_answer_and_the_next_question_still_goes(agent: _Agent, tmp_path: Path) -> None:
    peers = _peers(agent, tmp_path)
    agent.mode = "refuse"
    assert peers.ask_agent() is None
    agent.mode = "keep"
    assert peers.ask_agent() == ANSWER
    assert peers.answer == ANSWER


def test_an_agent_that_does_not_answer_is_no_answer(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: the connection is refused
        tok = tmp_path / "token"
        tok.write_text("tok-1\n")
        peers = Peers(f"http://127.0.0.1:{s.getsockname()[1]}", "ml/imagenet", REV, str(tok))
        assert peers.ask_agent() is None
        assert peers.ask_agent() is None


def test_a_first_question_answered_late_is_asked_once_more_with_a_longer_timeout(
    agent: _Agent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30: at N = 32 an agent answered some first questions after the stager's timeout; the
    stager then read every object from the bucket. The first question is asked once more, with
    FIRST_RETRY_S; only once per run, and the later questions keep the usual timeout."""
    monkeypatch.setattr(agentcall, "FIRST_RETRY_S", 3.0)
    peers = _peers(agent, tmp_path)
    peers._agent.timeout = 0.3
    agent.delay = 0.8  # longer than the timeout, shorter than FIRST_RETRY_S
    assert peers.ask_agent() == ANSWER
    assert len(agent.asked) == 2
    # Answered, then late again: no answer this time (the stager asks again a second later).
    peers.answer = None
    t0 = time.monotonic()
    assert peers.ask_agent() is None
    assert time.monotonic() - t0 < 0.8  # the usual timeout, not FIRST_RETRY_S
    assert len(agent.asked) == 3  # not asked twice: the safety net is spent
    agent.delay = 0.0
    assert peers.ask_agent() == ANSWER

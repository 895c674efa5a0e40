"""The agent's sending slots (server.MAX_SENDING) and a request asked not to wait (issue 30).

On a real agent server (a cache root in a temp dir; the API server is test_node_agent_review's
fake), every sending slot taken (MAX_SENDING 0): a body larger than SMALL_BODY needs a slot, so
a request held for it (``wait`` > 0) waits its turn, MIN_TURN_S at least, then hears "not yet"
(staging); one asked not to wait (a stager's sweep for a whole copy) hears it at once, so that
only a node with a free uplink slot serves a sweep; a small body needs no slot and comes.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract.peers import REVISION_HEADER, ObjectRequest
from dscache_node import server
from dscache_node.server import MIN_TURN_S, SMALL_BODY, make_server
from tests.support.s3server import free_port
from tests.unit.test_node_agent import R1, stage
from tests.unit.test_node_agent_review import gate, make_agent
from tests.unit.test_node_auth import jwt

LARGE = "d/large"
SMALL = "d/small"


@pytest.fixture
def busy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, dict[str, bytes]]]:
    """An agent whose sending slots are all taken, serving a complete revision of ml/c."""
    monkeypatch.setattr(server, "MAX_SENDING", 0)
    root = tmp_path / "root"
    root.mkdir()
    agent, _ = make_agent(root)
    c = stage(root, "ml", "c", R1, 10)
    data = Path(contract.data_dir(c, R1))
    (data / "d").mkdir()
    files = {LARGE: os.urandom(SMALL_BODY + 1), SMALL: os.urandom(SMALL_BODY)}
    for name, body in files.items():
        (data / name).write_bytes(body)
    port = free_port()
    srv = make_server(agent, gate(), port, addr="127.0.0.1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield port, files
    finally:
        srv.shutdown()
        srv.server_close()


def get(port: int, path: str, wait: float) -> tuple[int, str, bytes, float]:
    """(status, state or revision, body, seconds) of a probe with relay, as the stagers send."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    started = time.monotonic()
    try:
        target = ObjectRequest("ml", "c", R1, path, wait, True, True).target()
        conn.request("GET", target, headers={"Authorization": f"Bearer {jwt('stager')}"})
        resp = conn.getresponse()
        body = resp.read()
        state = json.loads(body).get("state", "") if resp.status == 404 else resp.getheader(REVISION_HEADER) or ""
        return resp.status, state, body, time.monotonic() - started
    finally:
        conn.close()


def test_asked_not_to_wait_a_busy_uplink_says_not_yet_at_once(busy):
    port, _ = busy
    status, state, _, took = get(port, LARGE, 0)
    assert (status, state) == (404, "staging")
    assert took < MIN_TURN_S / 2  # not the turn a held request waits for


def test_a_held_request_waits_its_turn_before_not_yet(busy):
    port, _ = busy
    status, state, _, took = get(port, LARGE, 0.2)
    assert (status, state) == (404, "staging")
    assert took >= MIN_TURN_S * 0.9


def test_a_small_body_needs_no_slot(busy):
    port, files = busy
    status, rev, body, _ = get(port, SMALL, 0)
    assert (status, rev, body) == (200, R1, files[SMALL])

"""An agent busy with the other nodes' first requests still answers its own stager (issue 30).

At a cohort's start every other node's stager shows this agent a token it has not seen (a
TokenReview and a pod's GET each, seconds long on a loaded API server). At N = 32 those checks held
every thread of the control pool, and this node's own stager, asking to reserve and then who its
peers are, waited past its 10 s timeout: it read every object from the bucket. A real agent server
on loopback; the API server is the fake of test_node_auth.py, slow for the peers' tokens only."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import dscache_contract as contract
from dscache_contract.peers import PEERS_PATH, PeersAnswer, PeersRequest
from dscache_node import server as server_mod
from dscache_node.server import make_server
from tests.support.s3server import free_port
from tests.unit.test_node_agent import R1, stage
from tests.unit.test_node_agent_review import make_agent, stager_at_work
from tests.unit.test_node_auth import FakeReviews, _name, jwt

#: Peers' tokens, each from an address of its own (as other nodes' stagers come): more than the
#: control pool has threads, and each address within its share of a pool.
PEERS = server_mod.CONTROL_THREADS + server_mod.CHECK_THREADS
#: How long the API server takes to review a peer's token (the stager's own: at once).
SLOW_S = 3.0
#: The own stager's reserve and peers question must both be answered within this.
BOUND_S = 1.5


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.fixture
def busy_agent(root: Path) -> Iterator[tuple[list[str], int, threading.Event]]:
    """An agent on n1 with a complete copy of ml/c R1 (what peers ask for) whose API server takes
    SLOW_S for each peer's TokenReview; the peers' reviews started, and an event that, once set,
    lets the held reviews go."""
    agent, _kube = make_agent(root)
    agent.last_refresh = time.monotonic()
    stage(str(root), "ml", "c", R1, 100)
    tokens: dict[str, Any] = {"stager": ("ml", "stager", "u-own")}
    pods: dict[str, Any] = {"u-own": ("d", "n1")}
    for i in range(PEERS):
        tokens[f"peer{i}"] = ("ml", f"peer{i}", f"u-{i}")
        pods[f"u-{i}"] = ("c", f"n{i + 2}")
    g = FakeReviews.gate("n1", tokens, pods)
    kube: FakeReviews = g.kube  # type: ignore[assignment]
    real_post, release, started = kube.post, threading.Event(), []

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        if (name := _name(body["spec"]["token"])).startswith("peer"):
            started.append(name)
            release.wait(SLOW_S)  # the API server under a cohort's start
        return real_post(path, body)

    kube.post = post  # type: ignore[method-assign]
    port = free_port()
    srv = make_server(agent, g, port, addr="127.0.0.1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield started, port, release
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()


def _peer_get(port: int, i: int) -> int:
    """A peer's object request, from an address of its own (127.0.0.<i + 2>)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(f"127.0.0.{i + 2}", 0))
    try:
        conn.request("GET", f"/v1/objects/ml/c/{R1}/blob", headers={"Authorization": f"Bearer {jwt(f'peer{i}')}"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _post(port: int, path: str, body: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {jwt('stager')}"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_own_stager_is_answered_while_peers_tokens_are_checked(root, busy_agent):
    started, port, release = busy_agent
    with ThreadPoolExecutor(PEERS) as pool:
        peers = [pool.submit(_peer_get, port, i) for i in range(PEERS)]
        # As many peers' checks have started as a pool has threads (the API server holds each).
        deadline = time.monotonic() + 5
        while len(started) < server_mod.CONTROL_THREADS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) >= server_mod.CONTROL_THREADS
        with stager_at_work(root, "ml", "d", R1):
            t0 = time.monotonic()
            code, text = _post(port, contract.RESERVE_PATH, contract.ReserveRequest("ml", "d", R1, 10).to_json())
            assert code == 200, text
            code, text = _post(port, PEERS_PATH, PeersRequest("ml", "d", R1).to_json())
            took = time.monotonic() - t0
        assert code == 200, text
        assert PeersAnswer.from_json(text) is not None
        assert took < BOUND_S, f"the node's own stager waited {took:.1f} s behind the peers' token checks"
        release.set()
        # The peers are served too, once their tokens are checked: nothing was refused for it.
        assert [p.result() for p in peers] == [200] * PEERS

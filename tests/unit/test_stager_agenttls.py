"""The stager's calls to agents over TLS (agenttls.py): a real agent server with the chart's kind of
certificate (one name, AGENT_TLS_NAME, reached at an IP); the stager checks it against the CA its
pod was given, and refuses a server another CA signed."""

from __future__ import annotations

import ssl
import threading

import pytest

import dscache_contract as contract
from dscache_contract.peers import PEER_CA_ENV, ObjectRequest
from dscache_node.agent import Agent
from dscache_node.metrics import AgentMetrics
from dscache_node.server import make_server, tls_context
from dscache_node.settings import AgentSettings
from dscache_stager import agentcall, agenttls
from tests.support.s3server import free_port
from tests.support.tlscerts import agent_certs
from tests.unit.test_node_agent import FakeKube, stage
from tests.unit.test_node_auth import FakeReviews, jwt

REV = "r-" + "b" * 20


@pytest.fixture
def tls_agent(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    ca, cert, key = agent_certs(tmp_path / "pki")
    port = free_port()
    a = Agent(AgentSettings(node="n1", cache_root=str(root), port=port), FakeKube(root), AgentMetrics())  # type: ignore[arg-type]
    gate = FakeReviews.gate("n1", {"stager": ("ml", "s", "u1")}, {"u1": ("c", "n2")})
    srv = make_server(a, gate, port, addr="127.0.0.1", tls=tls_context(str(cert), str(key)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield a, port, ca
    srv.shutdown()
    srv.server_close()


def test_objects_and_calls_over_tls_checked_against_the_ca(tls_agent, tmp_path, monkeypatch):
    agent, port, ca = tls_agent
    stage(agent.s.cache_root, "ml", "c", REV, 1000)
    monkeypatch.setenv(PEER_CA_ENV, ca.read_text())
    conn = agenttls.connection("127.0.0.1", port, 10)
    assert isinstance(conn, agenttls._AgentHTTPS)
    conn.request(
        "GET", ObjectRequest("ml", "c", REV, "blob").target(), headers={"Authorization": f"Bearer {jwt('stager')}"}
    )
    resp = conn.getresponse()
    assert (resp.status, resp.read()) == (200, b"x" * 1000)
    conn.close()
    # A reservation needs a pod on this node (this one runs on n2): the agent's answer, over TLS.
    body = contract.ReserveRequest("ml", "c", REV, 10).to_json()
    with pytest.raises(OSError, match="HTTP 403"):
        agentcall.post(f"https://127.0.0.1:{port}", contract.RESERVE_PATH, body, 10, jwt("stager"))
    # Another CA: the stager refuses the agent before it sends its token.
    other_ca, _, _ = agent_certs(tmp_path / "other")
    monkeypatch.setenv(PEER_CA_ENV, other_ca.read_text())
    with pytest.raises(ssl.SSLCertVerificationError):
        agentcall.post(f"https://127.0.0.1:{port}", contract.RESERVE_PATH, body, 10, jwt("stager"))
    # No CA given: plain HTTP, which a TLS agent does not answer.
    monkeypatch.delenv(PEER_CA_ENV)
    assert not isinstance(agenttls.connection("127.0.0.1", port, 10), agenttls._AgentHTTPS)

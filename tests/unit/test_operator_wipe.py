"""The controller's wipe, end to end against a real node agent on loopback: the request
(agentclient), what its answer means (nodeplan.judge_wipe) and what it records (nodeplan.record_wipe).

The agent runs in-process (no API server: it labels nothing; a fake one answers
its TokenReviews and the controller's TokenRequests), on a real cacheRoot in a temp
dir; the wipe itself is the stager's, under the flock. ``tls_agent``: the same over
TLS, with a CA and certificate as the chart makes them.
"""

from __future__ import annotations

import asyncio
import datetime
import fcntl
import json
import os
import threading

import pytest

import dscache_contract as contract
from dscache_node.agent import Agent
from dscache_node.metrics import AgentMetrics
from dscache_node.server import make_server, tls_context
from dscache_node.settings import AgentSettings
from dscache_operator.api.models import NodeState, NodeStatus
from dscache_operator.cluster.nodes import NodeInfo
from dscache_operator.control import agentclient
from dscache_operator.control import nodeplan as wipe
from dscache_operator.control.agenttokens import AgentTokens
from dscache_operator.control.nodeplan import LEGACY, Release
from dscache_operator.settings import Settings
from tests.support.s3server import free_port
from tests.support.tlscerts import agent_certs
from tests.unit.test_node_auth import FakeReviews, jwt

REV = "r-0123456789abcdef0123"


class ControllerKube:
    """The controller's API server: a TokenRequest gives ``token`` (the fake agent knows "controller")."""

    def __init__(self, token: str = "controller") -> None:
        self.token = token

    async def request(self, method: str, path: str, body: object = None, **_: object) -> dict:
        return {"status": {"token": jwt(self.token)}}


NOW = datetime.datetime(2026, 11, 21, 12, 0, 0, tzinfo=datetime.UTC)
_events: list[dict[str, str]] = []


@pytest.fixture
def events():
    """The Events the wipes' results asked for, as the executor would post them."""
    _events.clear()
    return _events


def _serve(tmp_path, tls: bool):
    root = tmp_path / "root"
    root.mkdir()
    port = free_port()
    a = Agent(AgentSettings(node="n1", cache_root=str(root), port=port), None, AgentMetrics())
    ctx = None
    if tls:
        _ca, cert, key = agent_certs(tmp_path / "pki")
        ctx = tls_context(str(cert), str(key))
    server = make_server(a, FakeReviews.gate("n1", {}, {}), port, addr="127.0.0.1", tls=ctx)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return a, server


@pytest.fixture
def agent(tmp_path):
    a, server = _serve(tmp_path, tls=False)
    yield a
    server.shutdown()
    server.server_close()


@pytest.fixture
def tls_agent(tmp_path):
    a, server = _serve(tmp_path, tls=True)
    yield a
    server.shutdown()
    server.server_close()


def settings(agent: Agent, tmp_path, ca: str | None = None) -> Settings:
    return Settings(cache_root=agent.s.cache_root, agent_port=agent.s.port, agent_ca_file=ca)


def node(agent: Agent | None) -> NodeInfo:
    port = agent.s.port if agent else None
    return NodeInfo("n1", "127.0.0.1", {}, (), frozenset(), agent is not None, True, port)


def staged(agent: Agent, leases: tuple[str, ...] = ()) -> str:
    c = contract.cache_dir(agent.s.cache_root, "ml", "c")
    os.makedirs(contract.data_dir(c, REV))
    os.makedirs(contract.meta_dir(c, REV))
    with open(contract.complete_path(c, REV), "w") as f:
        f.write(json.dumps({"objects": 0, "bytes": 0}))
    for uid in leases:
        os.makedirs(contract.lease_dir(c, REV), exist_ok=True)
        open(contract.lease_path(c, REV, uid), "w").close()
    return c


def drive(
    s: Settings,
    info: NodeInfo | None,
    step: Release,
    entry: NodeStatus | None = None,
    kube: ControllerKube | None = None,
):
    entry = entry or NodeStatus(node="n1", state=NodeState.READY)
    kube = kube or ControllerKube()
    req = wipe.request_for("ml", "c", step)
    answer = asyncio.run(agentclient.wipe(info, s, req, kube, AgentTokens()))  # type: ignore[arg-type]
    result = wipe.judge_wipe(entry, step, answer, s.namespace)
    wipe.record_wipe(entry, step, result, NOW)
    if result.event is not None:
        _events.append(dict(zip(("type", "reason", "message"), result.event, strict=True)))
    return result.outcome, list(result.leases), entry


def test_release_then_remove(agent, tmp_path, events):
    c = staged(agent, leases=("u1",))
    outcome, _, entry = drive(settings(agent, tmp_path), node(agent), Release(REV, ("u1",)))
    assert outcome is wipe.Outcome.REMOVED and entry.message is None
    assert not os.path.exists(contract.revision_dir(c, REV)) and os.path.isdir(c)
    assert [e["reason"] for e in events] == ["Wiped"]


def test_a_lease_not_released_keeps_it(agent, tmp_path, events):
    c = staged(agent, leases=("u1", "u2"))
    outcome, kept, entry = drive(settings(agent, tmp_path), node(agent), Release(REV, ("u1",)))
    assert outcome is wipe.Outcome.KEPT and kept == ["u2"]
    assert "u2" in (entry.message or "") and os.path.isdir(contract.revision_dir(c, REV))


def test_busy_while_a_stager_holds_the_lock(agent, tmp_path, events):
    c = staged(agent)
    fd = os.open(contract.lock_path(c), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        outcome, _, _ = drive(settings(agent, tmp_path), node(agent), Release(REV, ()))
    finally:
        os.close(fd)
    assert outcome is wipe.Outcome.IN_PROGRESS and events == []  # busy: simply asked again
    assert os.path.isdir(contract.revision_dir(c, REV))


def test_no_agent_on_the_node_says_so_once(agent, tmp_path, events):
    s = settings(agent, tmp_path)
    entry = NodeStatus(node="n1", state=NodeState.READY)
    for _ in range(3):
        outcome, _, entry = drive(s, node(None), Release(REV, ()), entry)
        assert outcome is wipe.Outcome.IN_PROGRESS
    assert "no dscache-node agent runs on node n1" in (entry.message or "")
    assert [e["reason"] for e in events] == ["WipeFailed"]


def test_a_wrong_token_is_refused(agent, tmp_path, events):
    c = staged(agent)
    outcome, _, entry = drive(settings(agent, tmp_path), node(agent), Release(REV, ()), kube=ControllerKube("nobody"))
    assert outcome is wipe.Outcome.IN_PROGRESS and "401" in (entry.message or "")
    assert os.path.isdir(contract.revision_dir(c, REV))


def test_over_tls_with_the_agents_ca(tls_agent, tmp_path, events):
    """The chart's TLS: the agent serves its certificate (named AGENT_TLS_NAME, reached at an IP);
    the controller checks it against the CA. Without the CA, or plain HTTP, no wipe."""
    c = staged(tls_agent, leases=("u1",))
    ca = str(tmp_path / "pki" / "ca.crt")
    outcome, _, entry = drive(settings(tls_agent, tmp_path), node(tls_agent), Release(REV, ("u1",)))
    assert outcome is wipe.Outcome.IN_PROGRESS and os.path.isdir(contract.revision_dir(c, REV))  # plain HTTP to TLS
    _other_ca, _, _ = agent_certs(tmp_path / "other")
    outcome, _, entry = drive(settings(tls_agent, tmp_path, str(_other_ca)), node(tls_agent), Release(REV, ("u1",)))
    assert outcome is wipe.Outcome.IN_PROGRESS and "certificate" in (entry.message or ""), entry.message
    assert os.path.isdir(contract.revision_dir(c, REV))
    outcome, _, entry = drive(settings(tls_agent, tmp_path, ca), node(tls_agent), Release(REV, ("u1",)))
    assert outcome is wipe.Outcome.REMOVED, entry.message
    assert not os.path.exists(contract.revision_dir(c, REV))


def test_whole_cache_and_legacy_requests():
    assert wipe.request_for("ml", "c", Release(None, ("u1",))) == contract.WipeRequest(
        "ml", "c", None, True, False, ("u1",)
    )
    assert wipe.request_for("ml", "c", Release(LEGACY, ("u1",))) == contract.WipeRequest(
        "ml", "c", None, False, True, ()
    )


def test_lease_uids_keeps_plain_uids_only():
    assert wipe.lease_uids(["u9", f"{REV}/u8", "u9", "../x"]) == ["u9"]

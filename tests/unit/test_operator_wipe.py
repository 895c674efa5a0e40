"""The controller's wipe, end to end against a real node agent on loopback: the request
(agentclient), what its answer means (nodeplan.judge_wipe) and what it records (nodeplan.record_wipe).

The agent runs in-process (no API server: it labels nothing), on a real
cacheRoot in a temp dir; the wipe itself is the stager's, under the flock.
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
from dscache_node.server import make_server
from dscache_node.settings import AgentSettings
from dscache_operator.api.models import NodeState, NodeStatus
from dscache_operator.cluster.nodes import NodeInfo
from dscache_operator.control import agentclient
from dscache_operator.control import nodeplan as wipe
from dscache_operator.control.nodeplan import LEGACY, Release
from dscache_operator.settings import Settings
from tests.support.s3server import free_port

REV = "r-0123456789abcdef0123"
TOKEN = "t0ken-for-tests"


NOW = datetime.datetime(2026, 11, 21, 12, 0, 0, tzinfo=datetime.UTC)
_events: list[dict[str, str]] = []


@pytest.fixture
def events():
    """The Events the wipes' results asked for, as the executor would post them."""
    _events.clear()
    return _events


@pytest.fixture
def agent(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    port = free_port()
    a = Agent(AgentSettings(node="n1", cache_root=str(root), port=port), None, AgentMetrics())
    server = make_server(a, lambda: TOKEN, port, addr="127.0.0.1")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield a
    server.shutdown()
    server.server_close()


def settings(agent: Agent, tmp_path) -> Settings:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return Settings(cache_root=agent.s.cache_root, agent_token_file=str(token), agent_port=agent.s.port)


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


def drive(s: Settings, info: NodeInfo | None, step: Release, entry: NodeStatus | None = None):
    entry = entry or NodeStatus(node="n1", state=NodeState.READY)
    answer = asyncio.run(agentclient.wipe(info, s, wipe.request_for("ml", "c", step)))
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
    s = Settings(cache_root=agent.s.cache_root, agent_token_file=None)
    outcome, _, entry = drive(s, node(agent), Release(REV, ()))
    assert outcome is wipe.Outcome.IN_PROGRESS and "401" in (entry.message or "")
    assert os.path.isdir(contract.revision_dir(c, REV))


def test_whole_cache_and_legacy_requests():
    assert wipe.request_for("ml", "c", Release(None, ("u1",))) == contract.WipeRequest(
        "ml", "c", None, True, False, ("u1",)
    )
    assert wipe.request_for("ml", "c", Release(LEGACY, ("u1",))) == contract.WipeRequest(
        "ml", "c", None, False, True, ()
    )


def test_lease_uids_keeps_plain_uids_only():
    assert wipe.lease_uids(["u9", f"{REV}/u8", "u9", "../x"]) == ["u9"]

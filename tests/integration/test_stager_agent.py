"""The stager asks its node's agent for room before a cold copy (--agent/--cache/--bytes).

A real S3 server, the real ``dscache-stage`` CLI, and a real node agent
(dscache-node, tests/support/nodeagent.py) whose cacheRoot holds the stager's
cache dir, as on a node.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import dscache_contract as contract
from tests.support.nodeagent import MiB, revision_on_disk, stage_copy, warm_labels
from tests.support.s3server import S3Server, free_port
from tests.support.stager import StageResult, boto3_revision, data_dir, data_tree, expected_tree, run_stage

pytestmark = pytest.mark.integration

NS = "ml"
FILES = {f"b/{i}.bin": os.urandom(MiB) for i in range(3)}


def stage_asking(
    server: S3Server, uri: str, c: Path, rev: str, agent: str, cache: str, nbytes: int, **kw
) -> StageResult:
    """The stager as the webhook runs it on a node with an agent: --agent, --cache, --bytes."""
    argv = contract.StageArgs(
        source=uri, revision=rev, cache_dir=str(c), pod_uid="pod-1", agent=agent, cache=cache, bytes=nbytes, **kw
    ).to_argv()
    return run_stage(server, *argv)


def peer_token_file(agent, tmp_path: Path, cache: str) -> str:
    """A stager pod's projected token, as the webhook mounts it: the agent reserves only for a pod
    of the cache on its node."""
    path = tmp_path / f"peer-token-{cache}"
    path.write_text(agent.peer_token(NS, cache))
    return str(path)


@pytest.fixture
def three_mib(s3_server: S3Server, bucket: str) -> tuple[str, str]:
    s3_server.put_tree(bucket, FILES)
    uri = f"s3://{bucket}/b/"
    return uri, boto3_revision(s3_server, uri)


def test_a_copy_the_budget_cannot_fit_fails_with_exit_4_naming_both_numbers(
    s3_server: S3Server, three_mib, agents, tmp_path: Path
):
    uri, rev = three_mib
    agent = agents.start("stager-node-full", env_extra={"DSCACHE_NODE_BUDGET": "2Mi"})
    # An unused copy the agent could evict: even without it, 3 MiB never fits in 2 MiB.
    other = "r-" + "0" * 20
    stage_copy(agent.cache_root, NS, "other", other, {"blob": b"o" * MiB})
    cache = agent.cache_root / NS / "big"
    r = stage_asking(
        s3_server,
        uri,
        cache,
        rev,
        agent.url,
        f"{NS}/big",
        3 * MiB,
        termination_log=str(tmp_path / "t"),
        peer_token_file=peer_token_file(agent, tmp_path, "big"),
    )
    assert r.code == 4, r.stderr
    msg = (tmp_path / "t").read_text()
    assert f"needs {3 * MiB} bytes" in msg and f"budget is {2 * MiB} bytes" in msg, msg
    assert f"node {agent.node}" in msg, msg
    assert not os.path.exists(contract.complete_path(str(cache), rev))
    assert not data_dir(cache, rev).exists() or not any(data_dir(cache, rev).rglob("*.bin")), "copied anyway"
    assert revision_on_disk(agent.cache_root, NS, "other", other), "evicted although that could not make room"


def test_the_agent_evicts_an_unused_copy_to_make_room_then_labels_the_new_one(
    kube_api, s3_server: S3Server, three_mib, agents, tmp_path: Path
):
    uri, rev = three_mib
    agent = agents.start("stager-node-evict", env_extra={"DSCACHE_NODE_BUDGET": "4Mi"})
    old = "r-" + "0" * 20
    stage_copy(agent.cache_root, NS, "old", old, {"blob": b"o" * (2 * MiB)})
    cache = agent.cache_root / NS / "fresh"
    r = stage_asking(
        s3_server,
        uri,
        cache,
        rev,
        agent.url,
        f"{NS}/fresh",
        3 * MiB,
        peer_token_file=peer_token_file(agent, tmp_path, "fresh"),
    )
    assert r.code == 0, r.stderr
    assert f"evicted 1 unused copy(ies) to make room: {NS}/old/{old}" in r.stderr, r.stderr
    assert not revision_on_disk(agent.cache_root, NS, "old", old)
    assert data_tree(data_dir(cache, rev)) == expected_tree(FILES, "b/")
    # The stager's own manifest verifies: the agent labels the node warm for it.
    kube_api.wait_for(
        lambda: contract.warm_label(NS, "fresh", rev) in warm_labels(kube_api, agent.node), what="warm label"
    )


def test_an_unreachable_agent_still_stages_with_the_free_space_check(
    s3_server: S3Server, three_mib, small_disk, tmp_path: Path
):
    uri, rev = three_mib
    nobody = f"http://127.0.0.1:{free_port()}"
    cache = tmp_path / "root" / NS / "c"
    r = stage_asking(s3_server, uri, cache, rev, nobody, f"{NS}/c", 3 * MiB)
    assert r.code == 0, r.stderr
    assert f"the node agent at {nobody} did not answer" in r.stderr and "checking free space only" in r.stderr
    assert data_tree(data_dir(cache, rev)) == expected_tree(FILES, "b/")
    # Without the agent, the free-space check is what stands between the copy and a full disk.
    disk = small_disk("2m")
    r = stage_asking(
        s3_server,
        uri,
        disk / NS / "c",
        rev,
        nobody,
        f"{NS}/c",
        3 * MiB,
        termination_log=str(tmp_path / "t"),
    )
    assert r.code == 4, r.stderr
    assert "did not answer" in r.stderr
    assert (tmp_path / "t").read_text().startswith("error: not enough space"), (tmp_path / "t").read_text()

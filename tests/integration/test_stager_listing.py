"""The listing from a peer (issue 30), in the integration tier: real stagers and real node agents
(tests/support/nodeagent.py) in front of a real S3 server, behind a proxy that counts the bucket's
listings (ListObjectsV2 requests; the access proof's empty page, which starts after every key, is
counted apart).

- two nodes staging one revision list the bucket once between them, and both copies are exact;
- a peer that serves a listing which does not hash to the revision: the stager says so, lists the
  bucket itself and still stages the revision exactly.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract.listings import ListingRequest, listing_line, listing_path
from tests.support.faultproxy import FaultProxy
from tests.support.nodeagent import NodeAgent, service_account_token
from tests.support.s3server import S3Server
from tests.support.stager import StageResult, boto3_revision, data_dir, data_tree, expected_tree, run_stage

pytestmark = pytest.mark.integration

NS = "ml"
CACHE = "listed"
LIAR = "listed-liar"
#: Fresh Node and cache names for each run (each data plane): the other runs' Nodes (their agents
#: stopped, their labels left) hold or copy the same revision of the same cache otherwise.
RUNS = itertools.count()
KiB = 1 << 10
FILES = {f"d/{i:03}.bin": os.urandom((i % 5 + 1) * 40 * KiB) for i in range(40)}
#: The access proof's start-after (listpage.PAST_EVERY_KEY after the prefix), as it goes on the wire.
PROOF = "start-after=" + urllib.parse.quote("d/\U0010ffff", safe="")


class ListCounter:
    """A FaultProxy policy that passes everything and counts the bucket's listings: full ones, and
    the access proof's empty pages."""

    def __init__(self, bucket: str) -> None:
        self.re = re.compile(rf"^GET /{re.escape(bucket)}/?\?(\S*&)?list-type=2")
        self.listings = 0
        self.proofs = 0
        self.lock = threading.Lock()

    def __call__(self, n: int, line: str) -> str:
        if self.re.match(line):
            with self.lock:
                if PROOF in line:
                    self.proofs += 1
                else:
                    self.listings += 1
        return "pass"


@pytest.fixture
def listed(s3_server: S3Server, bucket: str):
    s3_server.put_tree(bucket, FILES)
    counter = ListCounter(bucket)
    proxy = FaultProxy(upstream=(s3_server.host, s3_server.port), policy=counter).start()
    uri = f"s3://{bucket}/d/"
    yield uri, boto3_revision(s3_server, uri), proxy, counter
    proxy.stop()


def stage_on(
    s3_server: S3Server,
    proxy: FaultProxy,
    agent: NodeAgent,
    uri: str,
    rev: str,
    tmp: Path,
    cache: str = CACHE,
    cohort: bool = True,
) -> StageResult:
    token = tmp / f"token-{agent.node}"
    token.write_text(agent.peer_token(NS, cache))  # a stager pod of the cache on that agent's node
    argv = contract.StageArgs(
        source=uri,
        revision=rev,
        cache_dir=str(agent.cache_root / NS / cache),
        pod_uid=f"pod-{agent.node}",
        agent=agent.url,
        cache=f"{NS}/{cache}",
        peer_token_file=str(token),
        cohort=cohort,
    ).to_argv()
    return run_stage(s3_server, *argv, endpoint=proxy.endpoint)


def assert_exact(agent: NodeAgent, rev: str, cache: str = CACHE) -> None:
    c = agent.cache_root / NS / cache
    assert data_tree(data_dir(c, rev)) == expected_tree(FILES, "d/"), f"{agent.node}'s copy is not exact"
    assert os.path.exists(contract.complete_path(str(c), rev))


def test_two_nodes_list_the_bucket_once_between_them(
    s3_server: S3Server, listed, agents, kube_api, dscache_operator, tmp_path: Path
):
    uri, rev, proxy, counter = listed
    cache = f"{CACHE}{next(RUNS)}"
    node_sa = service_account_token(kube_api, "dscache-node", tmp_path / "node-sa-token")
    a, b = (
        agents.start(f"list-a{next(RUNS)}", kube_token_file=node_sa),
        agents.start(f"list-b{next(RUNS)}", kube_token_file=node_sa),
    )
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda ag: stage_on(s3_server, proxy, ag, uri, rev, tmp_path, cache), (a, b)))
    for agent, r in zip((a, b), runs, strict=True):
        assert r.code == 0, f"{agent.node}: {r.stderr}"
        assert_exact(agent, rev, cache)
    stderr = "\n".join(r.stderr for r in runs)
    # The bucket was listed once; each stager proved its own access with an empty page.
    assert counter.listings == 1, (counter.listings, stderr)
    assert counter.proofs == 2, (counter.proofs, stderr)
    assert stderr.count("took revision") == 1, stderr
    # Both nodes keep the listing (it hashed to the revision), so either serves it on.
    for agent in (a, b):
        with open(listing_path(str(agent.cache_root / NS / cache), rev)) as f:
            assert sum(1 for _ in f) == len(FILES)


def test_a_lone_node_lists_at_once_and_a_cohort_looks_again(s3_server: S3Server, listed, agents, tmp_path: Path):
    """Without --cohort (a lone Job) a node that sees no other one lists the bucket at once; with it
    (a gang's pod) it looks for peers once more before it lists. Either way it lists once."""
    uri, rev, proxy, counter = listed
    a = agents.start(f"lone-a{next(RUNS)}")
    lone = stage_on(s3_server, proxy, a, uri, rev, tmp_path, f"{CACHE}{next(RUNS)}", cohort=False)
    assert lone.code == 0, lone.stderr
    assert "looking again" not in lone.stderr, lone.stderr
    assert counter.listings == 1, (counter.listings, lone.stderr)
    gang = stage_on(s3_server, proxy, a, uri, rev, tmp_path, f"{CACHE}{next(RUNS)}", cohort=True)
    assert gang.code == 0, gang.stderr
    assert f"listing: no other node stages revision {rev} yet; looking again" in gang.stderr, gang.stderr
    assert counter.listings == 2, (counter.listings, gang.stderr)


def test_listing_from_a_peer_is_verified(s3_server: S3Server, listed, agents, tmp_path: Path):
    """Node A claims to be copying the revision (the cache's lock, a staging label), holds every
    object, and serves a listing with one ETag changed. Node B starts after the cohort window, so A
    ranks first for the listing: B must see that it does not hash to the revision, say so, list the
    bucket itself, and stage the revision exactly."""
    uri, rev, proxy, counter = listed
    liar = f"{LIAR}{next(RUNS)}"
    a = agents.start(f"liar-list-a{next(RUNS)}")
    c = a.cache_root / NS / liar
    data = data_dir(c, rev)
    for key, body in FILES.items():
        path = data / key.removeprefix("d/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    entries = {o["Key"]: o for o in s3_server.client().list_objects_v2(Bucket=uri.split("/")[2])["Contents"]}
    lie = "".join(
        listing_line(k, o["Size"], "0" * 32 if i == 7 else o["ETag"].strip('"'), None, False)
        for i, (k, o) in enumerate(sorted(entries.items()))
    )
    meta = Path(contract.meta_dir(str(c), rev))
    meta.mkdir(parents=True, exist_ok=True)
    Path(listing_path(str(c), rev)).write_text(lie)
    fd = os.open(contract.lock_path(str(c)), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # "a stager is copying here"
    try:
        code, text = a._http(
            "POST",
            contract.peers.PEERS_PATH,
            contract.PeersRequest(NS, liar, rev).to_json(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {a.peer_token(NS, liar)}"},
        )
        assert code == 200, text
        # A's agent serves the lie to a token of the cache (it checks nothing of the contents).
        code, text = a._http(
            "GET", ListingRequest(NS, liar, rev).target(), None, {"Authorization": f"Bearer {a.peer_token(NS, liar)}"}
        )
        assert code == 200 and text == lie, (code, text[:200])
        time.sleep(contract.peers.COHORT_WINDOW_S + 0.5)  # B is not in A's cohort: A ranks first
        b = agents.start(f"liar-list-b{next(RUNS)}")
        r = stage_on(s3_server, proxy, b, uri, rev, tmp_path, liar)
    finally:
        os.close(fd)
    assert r.code == 0, r.stderr
    assert_exact(b, rev, liar)
    assert re.search(r"listing: the listing 127\.0\.0\.1:\d+ sent does not hash to revision", r.stderr), r.stderr
    assert counter.listings == 1, (counter.listings, r.stderr)  # B listed the bucket itself
    # B keeps its own listing, the bucket's: it hashes to the revision.
    with open(listing_path(str(b.cache_root / NS / liar), rev)) as f:
        assert "0" * 32 not in f.read()

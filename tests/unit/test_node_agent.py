"""The node agent on a real cache root in a temp dir: its disk reading, budget and evictions.

The API server is a fake that records what the agent asks of it (the integration tier
runs the agent against a real one)."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_node import budget, disk
from dscache_node.agent import Agent
from dscache_node.metrics import AgentMetrics
from dscache_node.settings import AgentSettings, Size

R1, R2, R3 = "r-" + "1" * 20, "r-" + "2" * 20, "r-" + "3" * 20


class FakeKube:
    """Records node patches; ``root`` lets it note what was on disk at each patch."""

    def __init__(self, root: Path) -> None:
        self.labels: dict[str, str] = {}
        self.annotations: dict[str, str] = {}
        self.patches: list[tuple[dict, set[str]]] = []
        self.events: list[dict] = []
        self.root = root

    def get(self, path: str):
        if "/datasetcaches/" in path:
            return {"metadata": {"uid": "dsc-uid"}}
        return {"metadata": {"labels": dict(self.labels), "annotations": dict(self.annotations)}}

    def merge_patch(self, path: str, patch: dict):
        on_disk = {str(p.relative_to(self.root)) for p in self.root.glob("*/*/revs/r-*")}
        self.patches.append((patch, on_disk))
        for k, v in (patch["metadata"].get("labels") or {}).items():
            if v is None:
                self.labels.pop(k, None)
            else:
                self.labels[k] = v
        self.annotations.update(patch["metadata"].get("annotations") or {})
        return {}

    def post(self, path: str, body: dict):
        self.events.append(body)
        return {}


def stage(
    root: Path, ns: str, cache: str, rev: str, size: int, leases: tuple[str, ...] = (), released: float = 0
) -> str:
    """A complete revision as the stager leaves it: data, manifest, marker; optional leases."""
    c = contract.cache_dir(str(root), ns, cache)
    data = Path(contract.data_dir(c, rev))
    data.mkdir(parents=True)
    (data / "blob").write_bytes(b"x" * size)
    meta = Path(contract.meta_dir(c, rev))
    meta.mkdir(parents=True)
    entry = contract.ManifestEntry(key="p/blob", path="blob", size=size, etag="e")
    (meta / contract.MANIFEST_NAME).write_text(entry.to_json() + "\n")
    (meta / contract.COMPLETE_NAME).write_text(json.dumps({"objects": 1, "bytes": size}))
    leases_dir = Path(contract.lease_dir(c, rev))
    leases_dir.mkdir(parents=True)
    for uid in leases:
        (leases_dir / uid).write_text("{}")
    if released:
        os.utime(leases_dir, (released, released))
        os.utime(meta / contract.COMPLETE_NAME, (released, released))
    return c


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


def make_agent(root: Path, budget_bytes: int) -> tuple[Agent, FakeKube]:
    kube = FakeKube(root)
    s = AgentSettings(node="n1", cache_root=str(root), budget=Size(bytes=budget_bytes), headroom=Size(bytes=0))
    return Agent(s, kube, AgentMetrics()), kube  # type: ignore[arg-type]


def test_sizes_parse_bytes_quantities_and_percentages():
    assert Size.parse("B", "500Gi").bytes == 500 * 2**30
    assert Size.parse("B", "2T").bytes == 2 * 10**12
    assert Size.parse("B", "80%").of(1000) == 800
    with pytest.raises(ValueError, match="neither a byte quantity"):
        Size.parse("DSCACHE_NODE_BUDGET", "lots")


def test_scan_reads_complete_revisions_leases_and_skips_leftovers(root):
    stage(root, "ml", "a", R1, 100, leases=("u1",))
    stage(root, "ml", "b", R2, 200)
    (root / "ml" / "b" / "revs" / ".gone-r-x-1-1").mkdir()
    got = {(r.cache, r.revision): r for r in disk.scan(str(root))}
    assert set(got) == {("a", R1), ("b", R2)}
    assert got[("a", R1)].leases == ("u1",) and got[("b", R2)].bytes == 200 and got[("b", R2)].complete
    assert disk.finish_removals(str(root)) == 1 and disk.leftovers(str(root)) == []


def test_verify_catches_a_copy_cut_short(root):
    c = stage(root, "ml", "a", R1, 100)
    assert disk.verify(c, R1) is None
    Path(contract.data_dir(c, R1), "blob").write_bytes(b"x" * 99)
    assert "not a file of 100 bytes" in (disk.verify(c, R1) or "")


def test_victims_are_the_shortest_lru_prefix():
    def rev(name: str, size: int, at: float, leases=()) -> disk.OnDisk:
        return disk.OnDisk("ml", name, R1, size, True, leases, at, (1, 1))

    revs = [rev("old", 10, 1), rev("held", 50, 0, ("u",)), rev("mid", 30, 2), rev("new", 40, 3)]
    current = budget.room(100, 10**9, 0, revs, 0, 0)  # held 130 of 100
    cands = budget.evictable(revs)
    assert [r.cache for r in cands] == ["old", "mid", "new"]  # never the leased one
    assert [r.cache for r in budget.victims(20, current, cands) or []] == ["old", "mid", "new"]
    assert [r.cache for r in budget.victims(0, current, cands) or []] == ["old", "mid"]
    assert budget.victims(60, current, cands) is None  # 100 - 50 held by a lease < 60


def test_labels_follow_verified_copies_and_go_before_the_copy(root):
    now = time.time()
    stage(root, "ml", "a", R1, 100, released=now - 300)
    cb = stage(root, "ml", "b", R2, 100, released=now - 100)
    Path(contract.data_dir(cb, R2), "blob").unlink()  # cut short: never labelled
    agent, kube = make_agent(root, 10_000)
    agent.refresh()
    assert set(kube.labels) == {contract.AGENT_LABEL, contract.warm_label("ml", "a", R1)}
    inv = contract.Inventory.from_json(kube.annotations[contract.INVENTORY_ANNOTATION])
    assert {(r.of("ml", "a"), r.labelled) for r in inv.revisions} == {(True, True), (False, False)}
    # A wipe: the label comes off while the copy is still on disk, then the copy goes.
    summary = agent.wipe(contract.WipeRequest("ml", "a", revision=R1))
    assert summary.removed
    unlabel = next(
        p for p in kube.patches if contract.warm_label("ml", "a", R1) in (p[0]["metadata"].get("labels") or {})
    )
    assert f"ml/a/revs/{R1}" in unlabel[1]
    assert not Path(contract.revision_dir(contract.cache_dir(str(root), "ml", "a"), R1)).exists()


def test_reserve_evicts_least_recently_released_never_leased(root):
    now = time.time()
    stage(root, "ml", "old", R1, 100, released=now - 300)
    stage(root, "ml", "newer", R2, 100, released=now - 100)
    stage(root, "ml", "held", R3, 100, leases=("u1",), released=now - 1000)
    c = contract.cache_dir(str(root), "ml", "new")
    os.makedirs(c)
    each = disk.footprint(100, 1, disk.block_size(str(root)))  # one file of 100 bytes, in blocks
    agent, kube = make_agent(root, 3 * each + 50)
    fd = os.open(contract.lock_path(c), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a stager at work holds it
    try:
        answer = agent.reserve(contract.ReserveRequest("ml", "new", R1, 100))
        assert answer.ok and answer.evicted == [f"ml/old/{R1}"], answer
        assert {r.cache for r in disk.scan(str(root))} == {"newer", "held"}
        assert [e["reason"] for e in kube.events] == ["Evicted"]
        too_big = agent.reserve(contract.ReserveRequest("ml", "new", R1, 2 * each + 100))
        assert not too_big.ok and f"needs {2 * each + 100} bytes" in too_big.message
        assert f"budget is {3 * each + 50} bytes" in too_big.message
        assert {r.cache for r in disk.scan(str(root))} >= {"held"}  # in use: never evicted
    finally:
        os.close(fd)


def test_a_completed_copys_reservation_is_not_counted_besides_it(root):
    """A copy reserved, then completed and released before the agent's next pass (a CSI volume's
    lease goes at unpublish, at once): the next reservation counts the copy once, as held, not
    again as reserved, so it evicts one copy, not two."""
    now = time.time()
    stage(root, "ml", "old", R1, 100, released=now - 300)
    stage(root, "ml", "newer", R2, 100, released=now - 200)
    each = disk.footprint(100, 1, disk.block_size(str(root)))  # one file of 100 bytes, in blocks
    agent, _ = make_agent(root, 3 * each + 50)
    b = contract.cache_dir(str(root), "ml", "b")
    os.makedirs(b)
    fd = os.open(contract.lock_path(b), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    assert agent.reserve(contract.ReserveRequest("ml", "b", R3, 100, objects=1)).ok
    os.close(fd)  # b's stager is done: its copy is whole, and no pass of the agent ran since
    stage(root, "ml", "b", R3, 100, released=now - 100)
    d = contract.cache_dir(str(root), "ml", "d")
    os.makedirs(d)
    fd = os.open(contract.lock_path(d), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        answer = agent.reserve(contract.ReserveRequest("ml", "d", R1, 100, objects=1))
        assert answer.ok and answer.evicted == [f"ml/old/{R1}"], answer
    finally:
        os.close(fd)


def test_reserve_refuses_without_a_stager_at_work(root):
    c = contract.cache_dir(str(root), "ml", "new")
    os.makedirs(c)
    open(contract.lock_path(c), "w").close()
    agent, _ = make_agent(root, 10)
    answer = agent.reserve(contract.ReserveRequest("ml", "new", R1, 1))
    assert not answer.ok and "no stager holds the lock" in answer.message


def test_leases_of_finished_pods_are_released(root):
    stage(root, "ml", "a", R1, 10, leases=("done", "running", "unknown-young"))
    agent, _ = make_agent(root, 10_000)
    agent.pods.finished = {"done": True, "running": False}
    agent.pods.synced = True
    agent.refresh()
    (got,) = disk.scan(str(root))
    assert got.leases == ("running", "unknown-young")  # an unknown lease waits out its grace period

"""The node agent against a stranger and an unlucky node (issue 28): its server's bounds, the labels
a stager may make it write, its budget in disk blocks and across restarts, a resumed copy on a tight
disk, and calls that must not wait behind slow work. A real agent on a cache root in a temp dir; the
API server is the recording fake of test_node_agent.py."""

from __future__ import annotations

import fcntl
import http.client
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract.peers import PeersRequest, parse_staging_label
from dscache_node import disk
from dscache_node import server as server_mod
from dscache_node.agent import Agent
from dscache_node.metrics import AgentMetrics
from dscache_node.server import make_server
from dscache_node.settings import AgentSettings, Size
from tests.support.s3server import free_port
from tests.unit.test_node_agent import R1, R2, R3, FakeKube, stage
from tests.unit.test_node_auth import FakeReviews, jwt


def gate():
    """The agent's gate on a fake API server: the stager of ml/c on n1 (``jwt("stager")``) and the controller."""
    return FakeReviews.gate(
        "n1",
        tokens={"stager": ("ml", "stager-pod", "uid-1"), "other": ("ml", "other-pod", "uid-2")},
        pods={"uid-1": ("c", "n1"), "uid-2": ("other", "n1")},
    )


KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


def make_agent(root: Path, budget_bytes: int = 1 << 40) -> tuple[Agent, FakeKube]:
    kube = FakeKube(root)
    s = AgentSettings(node="n1", cache_root=str(root), budget=Size(bytes=budget_bytes), headroom=Size(bytes=0))
    return Agent(s, kube, AgentMetrics()), kube  # type: ignore[arg-type]


@contextmanager
def stager_at_work(root: Path, ns: str, cache: str, *revs: str) -> Iterator[str]:
    """A stager holding C's lock, copying ``revs`` (their data dirs exist, not complete)."""
    c = contract.cache_dir(str(root), ns, cache)
    os.makedirs(c, exist_ok=True)
    for rev in revs:
        os.makedirs(contract.data_dir(c, rev), exist_ok=True)
    fd = os.open(contract.lock_path(c), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield c
    finally:
        os.close(fd)


def staging_labels(kube: FakeKube) -> set[str]:
    return {k for k in kube.labels if parse_staging_label(k)}


# --- #3: the peers question labels the Node, so it is bounded and authenticated --------------------


def test_peers_post_cannot_flood_labels(root):
    """While a stager holds a cache's lock, asking about ever new revisions used to add one staging
    label per request. Now: one per cache at most (it moves), and none for a revision nobody copies."""
    revs = [f"r-{i:020x}" for i in range(40)]
    agent, kube = make_agent(root)
    with stager_at_work(root, "ml", "c", *revs[:30]):
        for rev in revs:
            agent.peers(PeersRequest("ml", "c", rev))
        assert len(staging_labels(kube)) <= 1, sorted(staging_labels(kube))
        patches = len(kube.patches)
        assert agent.peers(PeersRequest("ml", "c", revs[35])) is None  # no data dir: nothing copies it
        assert len(kube.patches) == patches
        # The copy in progress keeps its label while it asks again and again.
        agent.peers(PeersRequest("ml", "c", revs[0]))
        agent.peers(PeersRequest("ml", "c", revs[0]))
        assert staging_labels(kube) == {contract.peers.staging_label("ml", "c", revs[0])}


# --- #6, #12 and the hardening: the server ---------------------------------------------------------


@pytest.fixture
def served(root, monkeypatch):
    monkeypatch.setattr(server_mod, "IDLE_S", 1.0, raising=False)
    agent, _kube = make_agent(root)
    agent.last_refresh = time.monotonic()
    port = free_port()
    srv = make_server(agent, gate(), port, addr="127.0.0.1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield agent, port
    srv.shutdown()
    srv.server_close()


def healthz(port: int, source: str = "127.0.0.1") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=(source, 0))
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status
    finally:
        conn.close()


def test_agent_idle_connections_bounded(served):
    """300 idle connections held 303 threads and stayed open forever. Now they cost no thread, the
    ones past the per-client bounds (admitted, then told busy) are closed at once, the rest after
    IDLE_S, and healthz answers throughout."""
    _agent, port = served
    threads = threading.active_count()
    socks = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(s)
    time.sleep(0.3)
    # The kubelet's probe (another address than the one holding the connections) is answered.
    assert healthz(port, source="127.0.0.2") == 200
    assert threading.active_count() - threads < 20, "a thread per idle connection"
    deadline = time.monotonic() + 10
    open_ = list(socks)
    while open_ and time.monotonic() < deadline:
        still = []
        for s in open_:
            s.settimeout(0.05)
            try:
                if s.recv(1) == b"":
                    continue  # closed by the agent
            except TimeoutError:
                still.append(s)
            except OSError:
                continue
        open_ = still
    assert not open_, f"{len(open_)} idle connections still open after {server_mod.IDLE_S} s"
    for s in socks:
        s.close()
    assert healthz(port) == 200


def test_connections_past_the_bound_are_told_busy(root, monkeypatch):
    """Connections from one address past its bound used to be reset at once: a stager took that for
    a dead peer, wrote it off and read its objects from the bucket (fetch once lost). Now the next
    BUSY_PER_CLIENT get a 429 to their request (the stager asks again soon) and are closed; only
    past those is a connection reset. Another address is served throughout."""
    monkeypatch.setattr(server_mod, "MAX_PER_CLIENT", 4)
    monkeypatch.setattr(server_mod, "BUSY_PER_CLIENT", 2)
    agent, _kube = make_agent(root)
    agent.last_refresh = time.monotonic()
    port = free_port()
    srv = make_server(agent, gate(), port, addr="127.0.0.1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    conns = []
    try:
        for _ in range(7):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.connect()
            conns.append(conn)
            time.sleep(0.05)  # accepted in this order
        statuses: list[int | str] = []
        for conn in conns:
            try:
                conn.request("GET", "/healthz")
                resp = conn.getresponse()
                resp.read()
                statuses.append(resp.status)
            except OSError as e:
                statuses.append(type(e).__name__)
        assert statuses[:4] == [200] * 4, statuses
        assert statuses[4:6] == [429, 429], statuses
        assert isinstance(statuses[6], str), statuses  # past every bound: reset
        assert healthz(port, source="127.0.0.2") == 200
        # The busy ones were closed after their answer, so a new connection from that address
        # finds room among the busy again (the four admitted ones are still open).
        for conn in conns[4:]:
            conn.close()
        time.sleep(0.2)
        again = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        again.request("GET", "/healthz")
        assert again.getresponse().status == 429
        again.close()
    finally:
        for conn in conns:
            conn.close()
        srv.shutdown()
        srv.server_close()


def test_malformed_token_401(served):
    """A malformed token got a dropped connection; now 401. A malformed body is 400, an
    unauthenticated reservation or peers question 401, one of another cache's pod 403."""
    _agent, port = served

    def ask(method: str, path: str, body: str | None = None, token: str | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        try:
            conn.request(method, path, body=body, headers=headers)
            return conn.getresponse().status
        finally:
            conn.close()

    obj = f"/v1/objects/ml/c/{R1}/a.bin"
    assert ask("GET", obj, token="9" * 5000 + "." + "a" * 64) == 401
    assert ask("GET", obj, token="") == 401
    assert ask("GET", "/v1/objects/ml/c/not-a-rev/a.bin", token="x") == 400
    assert ask("POST", contract.RESERVE_PATH, "{not json", token="x") == 400
    req = contract.ReserveRequest("ml", "c", R1, 10).to_json()
    assert ask("POST", contract.RESERVE_PATH, req) == 401
    assert ask("POST", contract.peers.PEERS_PATH, PeersRequest("ml", "c", R1).to_json(), token="1.x") == 401
    assert ask("POST", contract.WIPE_PATH, contract.WipeRequest("ml", "c", revision=R1).to_json()) == 401
    # With the cache's own token: answered (no stager holds the lock: refused, not failed).
    assert ask("POST", contract.RESERVE_PATH, req, token=jwt("stager")) == 200
    assert ask("POST", contract.RESERVE_PATH, req, token=jwt("other")) == 403
    assert ask("POST", contract.WIPE_PATH, contract.WipeRequest("ml", "c", revision=R1).to_json(), jwt("stager")) == 401


# --- #7: the budget counts blocks, and survives a restart -----------------------------------------


def test_budget_counts_blocks(root):
    """1,000 objects of 1 KiB take 1,000 blocks at least, not 1,000 KiB: a complete copy counts its
    blocks against the budget, and so does a reservation that says how many objects it has."""
    c = contract.cache_dir(str(root), "ml", "small")
    data = Path(contract.data_dir(c, R1))
    data.mkdir(parents=True)
    lines = []
    for i in range(1000):
        (data / f"{i:04}").write_bytes(b"x" * KiB)
        lines.append(contract.ManifestEntry(key=f"p/{i:04}", path=f"{i:04}", size=KiB, etag="e").to_json())
    meta = Path(contract.meta_dir(c, R1))
    meta.mkdir(parents=True)
    (meta / contract.MANIFEST_NAME).write_text("\n".join(lines) + "\n")
    (meta / contract.COMPLETE_NAME).write_text(contract.StageSummary(objects=1000, bytes=1000 * KiB).to_json())
    block = os.statvfs(root).f_frsize
    agent, _ = make_agent(root, budget_bytes=1 << 30)
    held = agent._room(disk.scan(str(root))).held
    taken = sum(f.stat().st_blocks * 512 for f in data.iterdir())
    assert held >= 1000 * block, f"{held} bytes counted for 1000 files that take {taken}"
    assert held >= taken, "counted for less than the copy takes on the disk"
    # A reservation of 1,000 objects of 1 KiB under a budget of 2 MiB: refused (they take ~4 MiB).
    agent2, _ = make_agent(root / "other", budget_bytes=2 * MiB)
    with stager_at_work(root / "other", "ml", "new", R2):
        answer = agent2.reserve(contract.ReserveRequest("ml", "new", R2, 1000 * KiB, objects=1000))
        assert not answer.ok, answer
        assert agent2.reserve(contract.ReserveRequest("ml", "new", R2, 1000 * KiB, objects=10)).ok


def test_budget_survives_agent_restart(root):
    """A reservation of a copy in progress holds across an agent restart: the restarted agent does
    not promise the same bytes to another copy."""
    agent, _ = make_agent(root, budget_bytes=10 * MiB)
    with stager_at_work(root, "ml", "a", R1), stager_at_work(root, "ml", "b", R2):
        assert agent.reserve(contract.ReserveRequest("ml", "a", R1, 8 * MiB)).ok
        restarted, _ = make_agent(root, budget_bytes=10 * MiB)
        restarted.refresh()  # its first pass: the copy is still in progress (locked)
        answer = restarted.reserve(contract.ReserveRequest("ml", "b", R2, 8 * MiB))
        assert not answer.ok, "the restarted agent forgot the reservation of the copy in progress"
    # The stager let go: its reservation goes with the next pass.
    restarted.refresh()
    with stager_at_work(root, "ml", "b", R2):
        assert restarted.reserve(contract.ReserveRequest("ml", "b", R2, 8 * MiB)).ok


# --- #5: an interrupted copy on a tight disk resumes ----------------------------------------------


def test_resume_on_tight_disk(root, monkeypatch):
    """A copy interrupted at 60% asks again for its whole revision; the disk has 50% of it free (the
    rest is the partial copy itself). It must be let go on: the filesystem gives only what is left."""
    total = 8 * MiB
    with stager_at_work(root, "ml", "c", R1) as c:
        data = Path(contract.data_dir(c, R1))
        for i in range(6):
            (data / f"part-{i}").write_bytes(os.urandom(total // 10))
        on_disk = sum(f.stat().st_blocks * 512 for f in data.iterdir())
        assert on_disk >= 6 * total // 10
        monkeypatch.setattr(disk, "filesystem", lambda r: (100 * total, total // 2))
        agent, _ = make_agent(root, budget_bytes=100 * total)
        answer = agent.reserve(contract.ReserveRequest("ml", "c", R1, total))
        assert answer.ok, answer.message
        # A fresh copy of the same size elsewhere does not fit in that free space.
        with stager_at_work(root, "ml", "d", R2):
            assert not agent.reserve(contract.ReserveRequest("ml", "d", R2, total)).ok


# --- #11: calls do not wait behind slow work ----------------------------------------------------


def test_agent_answers_while_removing(root, monkeypatch):
    """A wipe of a large tree (its removal takes seconds) held the agent's lock throughout, and the
    peers question and reservations waited behind it. Now the tree is renamed away under the lock
    and removed off it: both answer at once."""
    import dscache_stager.layout as layout

    started, release = threading.Event(), threading.Event()
    real = layout.remove_tree

    def slow_remove(path: str) -> None:
        started.set()
        release.wait(10)  # a million files
        real(path)

    monkeypatch.setattr(layout, "remove_tree", slow_remove)
    monkeypatch.setattr("dscache_node.remover.remove_tree", slow_remove, raising=False)
    stage(root, "ml", "big", R1, 1000)
    agent, _kube = make_agent(root)
    wiper = threading.Thread(target=agent.wipe, args=(contract.WipeRequest("ml", "big", revision=R1),))
    try:
        wiper.start()
        assert started.wait(5)
        with stager_at_work(root, "ml", "other", R2), stager_at_work(root, "ml", "third", R3):
            t0 = time.monotonic()
            agent.peers(PeersRequest("ml", "other", R2))
            assert agent.reserve(contract.ReserveRequest("ml", "third", R3, 10)).ok
            took = time.monotonic() - t0
        assert took < 1.0, f"the calls waited {took:.1f} s behind a removal"
    finally:
        release.set()
        wiper.join(10)
    assert agent.remover.wait(10)
    assert not any(Path(contract.revisions_root(contract.cache_dir(str(root), "ml", "big"))).iterdir())


# --- #13: no tenant's names where another tenant reads ---------------------------------------------


def test_no_cross_tenant_names(root):
    """An eviction made for team-b's cache posts an Event in team-a's namespace: it must not name
    team-b or its cache. The Node's inventory, readable by anyone who may read Nodes, names no
    namespace or cache at all."""
    stage(root, "team-a", "victim", R1, 100, released=time.time() - 100)
    each = 100 + os.statvfs(root).f_frsize  # one file of 100 bytes, in blocks
    agent, kube = make_agent(root, budget_bytes=each + 50)
    with stager_at_work(root, "team-b", "secret-project", R2):
        answer = agent.reserve(contract.ReserveRequest("team-b", "secret-project", R2, each))
        assert answer.ok and answer.evicted, answer
    (event,) = kube.events
    assert event["metadata"]["namespace"] == "team-a"
    assert "team-b" not in event["message"] and "secret-project" not in event["message"], event["message"]
    stage(root, "team-b", "secret-project", R3, 10)
    agent.refresh()
    inventory = kube.annotations[contract.INVENTORY_ANNOTATION]
    for name in ("team-a", "victim", "team-b", "secret-project"):
        assert name not in inventory, inventory
    inv = contract.Inventory.from_json(inventory)
    assert sorted(r.revision for r in inv.revisions if r.of("team-b", "secret-project")) == [R2, R3]


# --- #10: two pre-staged caches over one node's budget ----------------------------------------------


def complete_copy(root: Path, ns: str, cache: str, rev: str, size: int, released: float) -> None:
    """The stager's copy of one file, whole and released (a pre-stage pod takes no lease)."""
    c = contract.cache_dir(str(root), ns, cache)
    data = Path(contract.data_dir(c, rev))
    data.mkdir(parents=True, exist_ok=True)
    (data / "blob").write_bytes(b"x" * size)
    meta = Path(contract.meta_dir(c, rev))
    meta.mkdir(parents=True, exist_ok=True)
    (meta / contract.MANIFEST_NAME).write_text(
        contract.ManifestEntry(key="p/blob", path="blob", size=size, etag="e").to_json() + "\n"
    )
    (meta / contract.COMPLETE_NAME).write_text(contract.StageSummary(objects=1, bytes=size).to_json())
    os.makedirs(contract.lease_dir(c, rev), exist_ok=True)
    os.utime(meta / contract.COMPLETE_NAME, (released, released))


def test_prestaged_caches_do_not_thrash(root):
    """Two caches pre-staged onto one node whose budget holds one of them: each pre-stage pod
    evicted the other's copy, and the controller replaced the other's pod minutes later, for ever
    (a full revision re-staged every few minutes). Now a pre-stage evicts no other pre-staged copy
    (nor one in use): the second is refused with a message for its status, every time, and the
    first copy stays. A Job's need still evicts a pre-staged copy (work comes first), and the marks
    survive an agent restart."""
    size = 3 * MiB
    each = disk.footprint(size, 1, disk.block_size(str(root)))
    agent, kube = make_agent(root, budget_bytes=each + each // 2)
    now = time.time()

    def prestage(cache: str, rev: str, done: bool = True) -> contract.ReserveAnswer:
        with stager_at_work(root, "ml", cache, rev):
            answer = agent.reserve(contract.ReserveRequest("ml", cache, rev, size, objects=1, prestage=True))
        if answer.ok and done:
            complete_copy(root, "ml", cache, rev, size, now)
        agent.refresh()
        return answer

    assert prestage("a", R1).ok
    # The controller retries the refused pre-stage pod (and after a restart of the agent too):
    # refused each time, and a's copy is never evicted for it.
    for round_ in range(4):
        if round_ == 2:
            agent, kube = make_agent(root, budget_bytes=each + each // 2)
        answer = prestage("b", R2)
        assert not answer.ok and answer.evicted == [], answer
        assert "not pre-staged on node n1" in answer.message and "another pre-staged copy" in answer.message
        assert "ml/a" not in answer.message, "the refusal names no other cache (tenant)"
        assert {(r.cache, r.complete) for r in disk.scan(str(root))} >= {("a", True)}
    assert not [e for e in kube.events if e.get("reason") == "Evicted"]
    # A Job's copy of b (no pre-stage) may evict the unused pre-staged copy of a: work first.
    with stager_at_work(root, "ml", "b", R2):
        job = agent.reserve(contract.ReserveRequest("ml", "b", R2, size, objects=1))
    assert job.ok and job.evicted == [f"ml/a/{R1}"], job
    complete_copy(root, "ml", "b", R2, size, now + 1)
    agent.refresh()
    # a's pre-stage may now evict b's copy (a Job's leftover, not pre-staged); then b's pre-stage is
    # refused again: the node settles on one pre-staged copy instead of taking turns.
    assert prestage("a", R1).ok
    assert not prestage("b", R2).ok
    assert {r.cache for r in disk.scan(str(root)) if r.complete} == {"a"}


def test_a_new_token_on_many_connections_at_once_is_checked_once(root):
    """A stager opens up to 64 connections at once with a token the agent has not seen. Each used to
    need its own TokenReview on the control pool, of which one address gets CONTROL_PER_CLIENT: the
    rest were told "busy", and the stager read those objects from the bucket (found by
    test_staggered_nodes_read_each_object_from_the_bucket_once). Now one check answers them all."""
    agent, _kube = make_agent(root)
    agent.last_refresh = time.monotonic()
    stage(str(root), "ml", "c", R1, 100)
    g = FakeReviews.gate("n1", {"stager": ("ml", "s", "u1")}, {"u1": ("c", "n2")})
    kube: FakeReviews = g.kube  # type: ignore[assignment]
    real_post = kube.post

    def slow_post(path: str, body: dict) -> dict:
        time.sleep(0.3)  # the API server under load: every request arrives while the first is checked
        return real_post(path, body)

    kube.post = slow_post  # type: ignore[method-assign]
    port = free_port()
    srv = make_server(agent, g, port, addr="127.0.0.1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    def fetch(_: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", f"/v1/objects/ml/c/{R1}/blob", headers={"Authorization": f"Bearer {jwt('stager')}"})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(48) as pool:
            statuses = list(pool.map(fetch, range(48)))
    finally:
        srv.shutdown()
        srv.server_close()
    assert statuses == [200] * 48, sorted(set(statuses))
    assert kube.reviews == ["stager"]

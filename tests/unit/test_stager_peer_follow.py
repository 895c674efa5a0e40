"""The stager's peer path without a thread per object (issue 30, small files through peers):

- ``Peers.chain`` keeps each key's chain for one answer and one set of failed peers, and gives
  exactly what the contract computes (a peer written off, a new answer: computed afresh);
- sync's native peer worker follows an "unclaimed" answer as ``Peers.obtain`` does (the parent's
  parent at once, the root again after a pause), on the native plane, each object's relay claimed
  once; an object that is this node's own by then goes to the native copier, not to obtain;
  every other answer still goes to obtain.

The native calls and the peers are stand-ins here (what they answer is the test's script); the
real ones are tests/unit/test_stager_peer_native.py's and tests/integration/test_stager_peers.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from dscache_contract.peers import Peer, PeersAnswer, fetch_chain, owner_ranking
from dscache_stager import peers as peers_mod
from dscache_stager import sync
from dscache_stager.objects import RemoteObject
from dscache_stager.peers import RERANK_S, ROOT_PAUSE_S, Obtained, Outcome, Peers

REV = "r-" + "0123456789abcdef0123"
ETAG = "0" * 32
ME = "10.0.0.1:1"
OTHERS = ["10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"]


def peers_for(tmp_path: Path, me: str = ME, others: list[str] = OTHERS) -> Peers:
    token = tmp_path / "token"
    token.write_text("tok")
    p = Peers("127.0.0.1:9", "ns/cache", REV, str(token))
    p.answer = PeersAnswer(me=me, staging=[Peer(a, 1000.0) for a in [me, *others]])
    return p


def uncached(p: Peers, key: str) -> list[str]:
    a = p.answer
    assert a is not None
    order = [x for x in owner_ranking(key, a) if x == a.me or x not in p.failed]
    return fetch_chain(key, order, a.me)


# --- Peers.chain, kept per key ------------------------------------------------------------------


def test_kept_chains_are_the_contracts_chains(tmp_path: Path) -> None:
    p = peers_for(tmp_path)
    keys = [f"k/{i}" for i in range(300)]
    first = [p.chain(k) for k in keys]
    assert first == [uncached(p, k) for k in keys]
    assert [p.chain(k) for k in keys] == first  # from what was kept
    assert any(first) and not all(first)  # some objects are this node's own (its root), most are not


def test_a_written_off_peer_leaves_the_kept_chains(tmp_path: Path) -> None:
    p = peers_for(tmp_path)
    keys = [f"k/{i}" for i in range(200)]
    before = [p.chain(k) for k in keys]
    gone = OTHERS[0]
    assert any(gone in c for c in before)
    p._fail(gone, "test")
    after = [p.chain(k) for k in keys]
    assert after == [uncached(p, k) for k in keys]
    assert not any(gone in c for c in after)


def test_a_new_answer_computes_the_chains_afresh(tmp_path: Path) -> None:
    p = peers_for(tmp_path)
    keys = [f"k/{i}" for i in range(200)]
    before = [p.chain(k) for k in keys]
    p.answer = PeersAnswer(me=ME, staging=[Peer(a, 1000.0) for a in [ME, *OTHERS[:1]]])
    after = [p.chain(k) for k in keys]
    assert after == [uncached(p, k) for k in keys] and after != before


def test_a_chain_handed_out_cannot_change_the_kept_one(tmp_path: Path) -> None:
    p = peers_for(tmp_path)
    key = next(f"k/{i}" for i in range(100) if p.chain(f"k/{i}"))
    p.chain(key).clear()
    assert p.chain(key) == uncached(p, key)


def test_without_its_own_label_the_ranking_is_not_kept(tmp_path: Path) -> None:
    """owner_ranking places a node missing from the staging list as starting now: such a ranking
    changes with the clock, so it is computed each time."""
    p = peers_for(tmp_path)
    p.answer = PeersAnswer(me=ME, staging=[Peer(a, 1000.0) for a in OTHERS])
    p.chain("k/1")
    assert p._chains[2] is None


def test_an_equal_answer_keeps_its_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = peers_for(tmp_path)
    kept = p.answer
    assert kept is not None
    same = PeersAnswer.from_json(kept.to_json())
    monkeypatch.setattr(p._agent, "post", lambda *a, **k: same.to_json())
    assert p.ask_agent() is kept and p.answer is kept
    other = PeersAnswer(me=ME, staging=[Peer(ME, 1000.0)])
    monkeypatch.setattr(p._agent, "post", lambda *a, **k: other.to_json())
    assert p.ask_agent() == other and p.answer == other


# --- sync's native peer worker ------------------------------------------------------------------


class Script:
    """A NativePeers stand-in: each object's chain, and per (object, peer) the answers it gives in
    turn (the last one for ever after)."""

    def __init__(self, chains: dict[str, list[str]], answers: dict[tuple[str, str], list[str]]) -> None:
        self.chains = chains
        self.answers = answers
        self.asked: list[tuple[str, str, float]] = []  # (key, peer, when)
        self.claims: list[str] = []
        self.calls = 0
        self.waits: list[list[float] | None] = []
        self.handed: Counter[str] = Counter()

    def route(self, key: str, etag: str, size: int, slow: frozenset[str] = frozenset()) -> list[str]:
        return list(self.chains[key])

    def hops(self, key: str, slow: frozenset[str] = frozenset()) -> int:
        return len(self.chains[key])

    async def ask(
        self, addr: str, wants: list[Any], tmp: Any, claim: Any, waits: list[float] | None = None, placed: Any = None
    ) -> list[Obtained | None]:
        self.waits.append(waits)
        return self.first(addr, wants, tmp, claim)  # placed: not told early (sync places them after)

    def first(self, addr: str, wants: list[Any], tmp: Any, claim: Any) -> list[Obtained | None]:
        self.calls += 1
        if claim is not None:
            claim("\n".join("+" + rel for _, rel, _, _ in wants))
        out: list[Obtained | None] = []
        for key, _, _, _ in wants:
            self.asked.append((key, addr, time.monotonic()))
            seq = self.answers[(key, addr)]
            said = seq.pop(0) if len(seq) > 1 else seq[0]
            out.append(
                Obtained(Outcome.PLACED, f"tmp-{key}")
                if said == "placed"
                else Obtained(Outcome.UNCLAIMED)
                if said == "unclaimed"
                else Obtained(Outcome.WAIT)
                if said == "wait"
                else None
            )
        return out


def fake_run(pn: Script, own: set[str]) -> Any:
    """The parts of sync._Run the native peer worker uses, recording what it was given."""
    run = SimpleNamespace(placed=[], obtained=[], obtained_with={}, to_bucket=[], claimed=[], relays=[])

    class FakePeers:
        def obtain(self, key: str, *a: Any) -> Obtained:
            run.obtained.append(key)
            run.obtained_with[key] = a[5:]  # (patience, held)
            return Obtained(Outcome.PLACED, f"tmp-{key}")

        def to_peers(self, key: str) -> bool:
            return key not in own

    async def peer_got(item: Any, got: Obtained, pool: Any) -> None:
        run.placed.append(item[0].key)

    async def bucket_native(item: Any) -> None:
        run.to_bucket.append(item[0].key)

    run.peers = FakePeers()
    run.native = object()
    run.tree = SimpleNamespace(ensure_parent=lambda rel: None)
    run._peer_placed = lambda item, tmp: run.placed.append(item[0].key)
    run._peer_got = peer_got
    run._bucket_native = bucket_native
    run._claim = lambda items: run.claimed.extend(i[0].key for i in items)
    run._relay_claim = lambda line: run.relays.extend(line.split("\n"))
    run._peer_tmp = lambda: "tmp"
    return run


def work(pn: Script, keys: list[str], own: set[str] = frozenset()) -> Any:  # type: ignore[assignment]
    run = fake_run(pn, set(own))

    async def go() -> None:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for k in keys:
            queue.put_nowait((RemoteObject(k, 100, ETAG), k, ""))
        queue.put_nowait(None)
        with ThreadPoolExecutor(4) as pool:
            await asyncio.wait_for(sync._Run._native_peer_worker(run, queue, pool, pn, 8), 20)  # type: ignore[arg-type]

    asyncio.run(go())
    return run


def test_unclaimed_goes_up_the_chain_then_asks_the_root_again_after_a_pause() -> None:
    parent, root = "p:1", "r:1"
    pn = Script(
        {"a": [parent, root]},
        {("a", parent): ["unclaimed", "unclaimed", "placed"], ("a", root): ["unclaimed"]},
    )
    run = work(pn, ["a"])
    assert run.placed == ["a"] and run.obtained == [] and run.to_bucket == []
    peers_asked = [addr for _, addr, _ in pn.asked]
    # the parent, its parent (the root) at once, then after a pause the chain again: the parent
    assert peers_asked == [parent, root, parent, root, parent]
    times = [t for _, _, t in pn.asked]
    assert times[1] - times[0] < ROOT_PAUSE_S / 2  # up the chain: no pause
    assert times[2] - times[1] >= ROOT_PAUSE_S / 2  # from the root: obtain's pause (jittered)
    assert times[4] - times[3] >= ROOT_PAUSE_S  # doubled
    assert run.relays == ["+a"]  # the relay claimed once, by the first request


def test_a_batch_of_unclaimed_objects_is_asked_again_together() -> None:
    root = "r:1"
    keys = [f"k{i}" for i in range(6)]
    pn = Script({k: [root] for k in keys}, {(k, root): ["unclaimed", "placed"] for k in keys})
    run = work(pn, keys)
    assert sorted(run.placed) == keys and run.obtained == []
    assert pn.calls <= 4  # not one native call per object


def test_an_object_that_became_this_nodes_own_goes_to_the_native_copier() -> None:
    pn = Script({"mine": [], "theirs": ["r:1"]}, {("theirs", "r:1"): ["placed"]})
    run = work(pn, ["mine", "theirs"], own={"mine"})
    assert run.to_bucket == ["mine"] and run.claimed == ["mine"]
    assert run.placed == ["theirs"] and run.obtained == []


def test_other_answers_and_early_probes_still_go_to_obtain() -> None:
    pn = Script({"busy": ["r:1"], "probe": []}, {("busy", "r:1"): ["other"]})
    run = work(pn, ["busy", "probe"])  # "probe": no chain, but early peers to ask (to_peers)
    # "busy": an answer the native call leaves to obtain (None), whose whole policy applies
    assert sorted(run.obtained) == ["busy", "probe"]
    assert sorted(run.placed) == ["busy", "probe"] and run.to_bucket == []
    assert [addr for _, addr, _ in pn.asked] == ["r:1"]


def test_the_worker_ends_with_every_room_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight in flight at most: 40 objects that need two rounds each all end (no room lost)."""
    root = "r:1"
    keys = [f"k{i}" for i in range(40)]
    monkeypatch.setattr(peers_mod, "ROOT_PAUSE_S", 0.001)
    pn = Script({k: [root] for k in keys}, {(k, root): ["unclaimed", "placed"] for k in keys})
    run = work(pn, keys)
    assert sorted(run.placed) == sorted(keys)


def test_a_root_that_never_reads_the_object_hands_it_to_obtain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A live root that answers "unclaimed" for ever: past peers.PATIENCE_S the object goes to
    obtain (whose patience writes that root off), not round the native loop for ever."""
    root = "r:1"
    monkeypatch.setattr(peers_mod, "ROOT_PAUSE_S", 0.001)
    monkeypatch.setattr(peers_mod, "ROOT_PAUSE_MAX_S", 0.005)
    monkeypatch.setattr(peers_mod, "PATIENCE_S", 0.2)
    pn = Script({"a": [root], "b": [root]}, {("a", root): ["unclaimed"], ("b", root): ["unclaimed", "placed"]})
    run = work(pn, ["a", "b"])
    assert run.obtained == ["a"] and sorted(run.placed) == ["a", "b"]
    asked_a = [t for k, _, t in pn.asked if k == "a"]
    assert len(asked_a) > 2 and asked_a[-1] - asked_a[0] >= 0.2 * 0.9


def test_a_copy_still_in_progress_is_asked_again_natively() -> None:
    """A held request answered "still copying": the chain again at once, on the native plane, the
    peer's patience for the object carried (its hold no longer than what is left of it)."""
    parent, root = "p:1", "r:1"
    pn = Script({"a": [parent, root]}, {("a", parent): ["wait", "placed"], ("a", root): ["unclaimed"]})
    run = work(pn, ["a"])
    assert run.placed == ["a"] and run.obtained == []
    assert [addr for _, addr, _ in pn.asked] == [parent, parent]
    assert pn.waits[0] is None  # the first request: obtain's RERANK_S hold
    assert pn.waits[1] is not None and 0 < pn.waits[1][0] <= RERANK_S
    assert run.relays == ["+a"]


def test_a_peer_still_copying_past_its_patience_goes_to_obtain_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past peers.PATIENCE_S of "still copying", obtain gets the object with the patience spent
    (it writes that peer off at once) and the hop that held without sending (passed over)."""
    parent, root = "p:1", "r:1"
    monkeypatch.setattr(peers_mod, "PATIENCE_S", 0.2)
    pn = Script({"a": [parent, root]}, {("a", parent): ["wait"], ("a", root): ["unclaimed"]})
    started = time.monotonic()
    run = work(pn, ["a"])
    assert run.obtained == ["a"] and run.placed == ["a"]
    patience, held = run.obtained_with["a"]
    assert set(patience) == {parent} and started + 0.2 <= patience[parent] <= time.monotonic()
    assert held == frozenset({parent})  # below the root: obtain passes it over for a complete copy
    assert {addr for _, addr, _ in pn.asked} == {parent}


def test_objects_behind_their_roots_first_unclaimed_key_wait_without_asking(monkeypatch: pytest.MonkeyPatch) -> None:
    """A root that has not come to k0 has not come to k1..k5 (it claims in listing order): while it
    says so for k0, only k0 is asked again; the others wait, and are asked once it has come to k0."""
    root = "r:1"
    monkeypatch.setattr(peers_mod, "ROOT_PAUSE_S", 0.01)
    monkeypatch.setattr(peers_mod, "ROOT_PAUSE_MAX_S", 0.02)
    keys = [f"k{i}" for i in range(6)]
    answers = {(k, root): ["unclaimed"] * (4 if k == "k0" else 1) + ["placed"] for k in keys}
    pn = Script({k: [root] for k in keys}, answers)
    run = work(pn, keys)
    assert sorted(run.placed) == keys and run.obtained == []
    k0_done = max(t for k, _, t in pn.asked if k == "k0")
    before = [k for k, _, t in pn.asked if t < k0_done]
    assert before.count("k0") == 4  # asked round after round
    assert sorted(k for k in before if k != "k0") == keys[1:]  # the others: their first request only
    # k0: 4 x "unclaimed" and the body; k1..k5: one "unclaimed" and the body (without the mark
    # each was asked every round k0 was: 5 + 5 x 5 requests)
    assert len(pn.asked) == 5 + 5 * 2


def test_a_parent_behind_an_earlier_key_is_passed_for_the_root_at_once() -> None:
    """A parent that has not come to k00 has not come to the keys after it: objects dispatched
    after its "unclaimed" go to the next hop up without asking it first."""
    parent, root = "p:1", "r:1"
    keys = [f"k{i:02}" for i in range(12)]
    pn = Script(
        {k: [parent, root] for k in keys},
        {**{(k, parent): ["unclaimed"] for k in keys}, **{(k, root): ["placed"] for k in keys}},
    )
    run = work(pn, keys)  # 8 in flight at most: k08.. are dispatched after the first answers
    assert sorted(run.placed) == keys and run.obtained == []
    asked_parent = sorted(k for k, addr, _ in pn.asked if addr == parent)
    assert asked_parent == keys[:8]  # the first batch asked it; the later objects did not
    assert sorted(k for k, addr, _ in pn.asked if addr == root) == keys
    assert sorted(run.relays) == sorted("+" + k for k in keys)  # every relay claimed, once

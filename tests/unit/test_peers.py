"""Fetch once per cluster (issue 17), piece by piece: the contract (peer tokens, object
requests, the rendezvous ranking, staging labels), the stager's check of a peer's body
against the listed ETag, and the agent's side (which files it serves, how it waits for an
object in flight) on a real cache tree in a temp dir, laid out by dscache_contract."""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract.peers import (
    COHORT_WINDOW_S,
    MAX_WAIT_S,
    OBJECTS_PATH,
    RELAY_MARK,
    ObjectRequest,
    Peer,
    PeersAnswer,
    RevisionState,
    claims_path,
    fetch_chain,
    owner_ranking,
    parse_staging_label,
    staging_label,
)
from dscache_node.agent import _locked
from dscache_node.peers import Claims, NotHere, Opened, check_request, open_object, poll_object, wait_for_object
from dscache_stager.peers import Digest, verifiable

REV = "r-" + "0123456789abcdef0123"
MiB = 1 << 20


# --- object requests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "a.bin",
        "train/shard-00001.tar",
        "with space/and  two spaces .txt",
        "ünïcödé/日本語/😀.bin",
        "odd?#%&=+;,'\"!/~name[1]",
        "percent%2Fslash/%25",
    ],
)
@pytest.mark.parametrize(("wait", "probe"), [(0.0, False), (1.5, False), (MAX_WAIT_S, True), (0.25, True)])
def test_an_object_request_round_trips(path, wait, probe):
    req = ObjectRequest("team-a", "my.cache", REV, path, wait, probe)
    target = req.target()
    assert target.startswith(OBJECTS_PATH) and " " not in target
    assert ObjectRequest.parse(target) == req


@pytest.mark.parametrize("asked", [MAX_WAIT_S + 0.001, 60, 1e9, "inf"])
def test_the_wait_is_capped(asked):
    req = ObjectRequest.parse(f"{OBJECTS_PATH}ns/c/{REV}/a.bin?wait={asked}")
    assert req.wait == MAX_WAIT_S
    assert ObjectRequest.parse(f"{OBJECTS_PATH}ns/c/{REV}/a.bin?wait=-5").wait == 0.0
    assert ObjectRequest.parse(f"{OBJECTS_PATH}ns/c/{REV}/a.bin").wait == 0.0


def test_a_nan_wait_is_capped_too():
    req = ObjectRequest.parse(f"{OBJECTS_PATH}ns/c/{REV}/a.bin?wait=nan")
    assert 0.0 <= req.wait <= MAX_WAIT_S, f"wait={req.wait!r} is not within [0, MAX_WAIT_S]"


@pytest.mark.parametrize(
    "target",
    [
        "/v1/other/ns/c/" + REV + "/a",
        OBJECTS_PATH + "ns/c/" + REV,  # no path
        OBJECTS_PATH + "ns/c/" + REV + "/",  # an empty path
        OBJECTS_PATH + "ns//" + REV + "/a",  # no cache
        OBJECTS_PATH + "ns/c/" + REV + "/a//b",  # an empty segment
        OBJECTS_PATH + "ns/c/r-123/a",  # not a revision
        OBJECTS_PATH + "ns/c/../a",
        OBJECTS_PATH + "ns/c/" + REV + "/a?wait=soon",
    ],
)
def test_a_malformed_object_path_raises_value_error(target):
    with pytest.raises(ValueError):
        ObjectRequest.parse(target)


@pytest.mark.parametrize(
    "path", ["..", "../x", "a/../../x", "a/./b", "/etc/passwd", "a//b", "a\x00b", "a\nb", "x/" + "n" * 300]
)
def test_check_request_refuses_a_path_that_could_step_outside(path):
    with pytest.raises(ValueError):
        check_request("ns", "c", path)


def test_a_dot_dot_path_parses_and_check_request_stops_it():
    req = ObjectRequest.parse(f"{OBJECTS_PATH}ns/c/{REV}/a/%2E%2E/%2e%2e/etc/passwd")
    assert req.path == "a/../../etc/passwd"
    with pytest.raises(ValueError, match=r"'\.\.' segment"):
        check_request(req.namespace, req.cache, req.path)


def test_check_request_refuses_names_that_are_not_namespace_and_cache():
    check_request("team-a", "my.cache", "a/b.bin")
    for ns, cache in (("Team", "c"), ("ns", "../c"), ("ns", "a/b"), ("", "c"), ("ns", "")):
        with pytest.raises(ValueError):
            check_request(ns, cache, "a.bin")


# --- the ranking --------------------------------------------------------------------------------------

T0 = 1_700_000_000.0
COHORT = [Peer("10.0.0.1:7070", T0), Peer("10.0.0.2:7070", T0 + 0.5), Peer("10.0.0.3:7070", T0 + COHORT_WINDOW_S)]
LATE = Peer("10.0.0.4:7070", T0 + COHORT_WINDOW_S + 5)
DONE = Peer("10.0.0.9:7070")


def answer_for(me: str, staging: list[Peer], complete: list[Peer] | None = None) -> PeersAnswer:
    return PeersAnswer(me=me, staging=list(staging), complete=list(complete or []))


def test_every_node_computes_the_same_ranking():
    staging = [*COHORT, LATE]
    for i in range(200):
        key = f"train/shard-{i:05d}.tar"
        orders = {tuple(owner_ranking(key, answer_for(p.addr, staging, [DONE]))) for p in staging}
        assert len(orders) == 1, key
        (order,) = orders
        assert sorted(order) == sorted([p.addr for p in staging] + [DONE.addr])


def test_complete_copies_then_the_cohort_then_later_stagers():
    cohort = {p.addr for p in COHORT}
    firsts = Counter()
    for i in range(300):
        order = owner_ranking(f"k{i}", answer_for(COHORT[1].addr, [*COHORT, LATE], [DONE]))
        assert order[0] == DONE.addr
        assert set(order[1:4]) == cohort and order[4] == LATE.addr
        firsts[order[1]] += 1
    assert set(firsts) == cohort  # each cohort member is first after the complete copy for some keys


def test_a_stager_that_started_after_the_window_is_never_first():
    staging = [*COHORT, LATE]
    for i in range(500):
        assert owner_ranking(f"k{i}", answer_for(LATE.addr, staging))[-1] == LATE.addr


def test_each_cohort_member_is_first_for_about_a_third_of_the_keys():
    n_keys = 6000
    firsts = Counter(
        owner_ranking(f"data/{i:06d}.bin", answer_for(COHORT[0].addr, [*COHORT, LATE]))[0] for i in range(n_keys)
    )
    assert set(firsts) == {p.addr for p in COHORT}
    for addr, n in firsts.items():
        # 1/3 each, within a few standard deviations (sd ~ 37 for 6000 keys)
        assert abs(n - n_keys / 3) < 200, (addr, firsts)


def test_the_asking_node_is_in_its_ranking_even_before_its_label_shows():
    order = owner_ranking("a.bin", answer_for("10.0.0.7:7070", COHORT))
    assert "10.0.0.7:7070" in order and len(order) == 4


def test_a_node_that_holds_the_revision_complete_is_never_asked_of_itself():
    me = DONE.addr
    order = owner_ranking("a.bin", answer_for(me, [Peer(me, T0)], [DONE, Peer("10.0.0.8:7070")]))
    assert order.count(me) == 1 and order[0] == "10.0.0.8:7070"


# --- each object's tree (issue 30) ---------------------------------------------------------------


def many(n: int) -> list[Peer]:
    return [Peer(f"10.1.{i // 250}.{i % 250}:7070", T0 + (i % 3)) for i in range(n)]


def test_a_nodes_chain_climbs_to_the_objects_root_through_earlier_ranked_nodes():
    staging = many(32)
    for i in range(100):
        key = f"k{i}"
        order = owner_ranking(key, answer_for(staging[0].addr, staging))
        for p in staging:
            chain = fetch_chain(key, order, p.addr)
            if p.addr == order[0]:
                assert chain == []
                continue
            assert chain[-1] == order[0]  # ends at the root, the one that reads the bucket
            assert len(set(chain)) == len(chain) and p.addr not in chain  # always up: no cycle
    assert fetch_chain("k", ["a", "b"], "c") == []  # not in the ranking: no chain


def test_the_trees_spread_the_serving_over_every_node_and_stay_shallow():
    """What issue 30 measured: a few early nodes served everyone (32 nodes: 5 served all). In the
    objects' trees every node is a parent of about one node per object, and a chain is short."""
    staging = many(32)
    children: Counter[str] = Counter()
    depths = []
    n_keys = 400
    for i in range(n_keys):
        key = f"train/{i:05d}.tar"
        order = owner_ranking(key, answer_for(staging[0].addr, staging))
        for p in staging:
            if chain := fetch_chain(key, order, p.addr):
                children[chain[0]] += 1
                depths.append(len(chain))
    assert len(children) == 32, "every node serves some objects on"
    # Each node passes an object on to two at most, and about one in all (31 copies over 32 nodes).
    assert max(children.values()) < 1.3 * n_keys, children.most_common(3)
    assert max(depths) <= 5  # log2(32)


# --- labels and names ---------------------------------------------------------------------------------


def test_a_staging_label_round_trips():
    key = staging_label("team-a", "imagenet", REV)
    assert key.startswith("staging.dscache.io/")
    assert len(key.partition("/")[2]) <= 63  # a label key's name part
    assert parse_staging_label(key) == (contract.cache_digest("team-a", "imagenet"), REV)
    assert staging_label("team-b", "imagenet", REV) != key
    for other in (contract.warm_label("team-a", "imagenet", REV), key + "x", key.replace("staging", "warm"), ""):
        assert parse_staging_label(other) is None
    with pytest.raises(ValueError):
        staging_label("team-a", "imagenet", "r-short")


# --- the stager's check of a peer's body ----------------------------------------------------------------


def body(size: int, seed: int = 1) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * 64  # 2 KiB, not periodic at 1 MiB
    return (block * (size // len(block) + 1))[:size]


def multipart_etag(data: bytes, part: int) -> str:
    """What S3 lists for a multipart upload: md5 of the parts' md5s, then '-<parts>'."""
    digests = [hashlib.md5(data[i : i + part]).digest() for i in range(0, len(data), part)]
    return f'"{hashlib.md5(b"".join(digests)).hexdigest()}-{len(digests)}"'


def feed(digest: Digest, data: bytes, chunks: Iterator[int]) -> Digest:
    at = 0
    while at < len(data):
        n = next(chunks)
        digest.update(memoryview(data)[at : at + n] if n % 2 else data[at : at + n])
        at += n
    return digest


def odd_chunks() -> Iterator[int]:
    sizes = [1, 7, 4093, MiB + 3, 65_537, 3 * MiB - 1, 999_983]
    while True:
        yield from sizes


def test_a_plain_md5_etag_matches_the_right_bytes_only():
    data = body(3 * MiB + 17)
    etag = f'"{hashlib.md5(data).hexdigest()}"'
    assert verifiable(etag, len(data))
    assert feed(Digest(etag, len(data)), data, odd_chunks()).matches()
    assert feed(Digest(etag.upper(), len(data)), data, odd_chunks()).matches()  # the case of the hex
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    assert not feed(Digest(etag, len(data)), bytes(flipped), odd_chunks()).matches()


@pytest.mark.parametrize("part", [8 * MiB, 5 * MiB])
@pytest.mark.parametrize("extra", [0, 1, 123_457])
def test_a_multipart_etag_is_verified_from_odd_chunks(part, extra):
    data = body(2 * part + extra, seed=part + extra)
    etag = multipart_etag(data, part)
    assert verifiable(etag, len(data))
    assert feed(Digest(etag, len(data)), data, odd_chunks()).matches()
    flipped = bytearray(data)
    flipped[-1] ^= 0x80
    assert not feed(Digest(etag, len(data)), bytes(flipped), odd_chunks()).matches()
    swapped = data[part:] + data[:part]  # the same parts in another order
    if swapped != data:
        assert not feed(Digest(etag, len(data)), swapped, odd_chunks()).matches()


def test_a_multipart_etag_of_one_part_is_verified():
    data = body(3 * MiB)
    etag = multipart_etag(data, 8 * MiB)
    assert etag.endswith('-1"') and feed(Digest(etag, len(data)), data, odd_chunks()).matches()


@pytest.mark.parametrize(
    ("etag", "size"),
    [
        ('"' + "ab" * 20 + '"', 1000),  # 40 hex digits: an opaque ETag, not an MD5
        ('"' + "0f" * 32 + '"', 1000),  # 64 hex
        ('"' + "a" * 32 + '-3"', 1000),  # 3 parts of 1000 bytes: no uploader's part size gives that
        ('"' + "a" * 32 + '-0"', 1000),
        ('"not-an-etag"', 1000),
        ('""', 1000),
        ('"' + "a" * 32 + '"', 0),  # an empty object: nothing to take from a peer
        ('"d41d8cd98f00b204e9800998ecf8427e"', 0),  # MD5 of nothing, still size 0
    ],
)
def test_an_etag_that_cannot_check_the_bytes_is_not_verifiable(etag, size):
    assert not verifiable(etag, size)


# --- the agent's side, on a real cache tree ---------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path) -> str:
    """C with one revision in progress: data/ (two placed objects), tmp/, meta/, and C/lock."""
    c = contract.cache_dir(str(tmp_path / "root"), "team-a", "imagenet")
    for d in (contract.data_dir(c, REV), contract.tmp_dir(c, REV), contract.meta_dir(c, REV)):
        os.makedirs(d)
    Path(contract.lock_path(c)).touch()
    os.makedirs(os.path.join(contract.data_dir(c, REV), "train"))
    Path(contract.data_dir(c, REV), "a.bin").write_bytes(b"A" * 1000)
    Path(contract.data_dir(c, REV), "train", "b.bin").write_bytes(b"B" * 10)
    return c


@pytest.fixture
def stager_lock(cache: str) -> Iterator[None]:
    """What a stager copying the revision holds: C's flock (from another open file description)."""
    fd = os.open(contract.lock_path(cache), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
    os.close(fd)


def read(opened) -> bytes:
    try:
        return os.pread(opened.fd, opened.size + 1, 0)
    finally:
        os.close(opened.fd)


def test_a_regular_file_is_served(cache):
    opened = open_object(cache, REV, "a.bin")
    assert opened.size == 1000 and read(opened) == b"A" * 1000
    assert read(open_object(cache, REV, "train/b.bin")) == b"B" * 10


def test_a_served_file_is_open_read_only(cache):
    opened = open_object(cache, REV, "a.bin")
    try:
        with pytest.raises(OSError):
            os.write(opened.fd, b"x")
    finally:
        os.close(opened.fd)


def test_a_symlinked_file_is_refused(cache, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    os.symlink(secret, os.path.join(contract.data_dir(cache, REV), "link.bin"))
    os.symlink("a.bin", os.path.join(contract.data_dir(cache, REV), "rel.bin"))
    for name in ("link.bin", "rel.bin"):
        with pytest.raises(FileNotFoundError):
            open_object(cache, REV, name)


def test_a_symlinked_directory_component_is_refused(cache, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "c.bin").write_text("host secret")
    os.symlink(outside, os.path.join(contract.data_dir(cache, REV), "linked"))
    os.symlink("train", os.path.join(contract.data_dir(cache, REV), "train2"))
    for path in ("linked/c.bin", "train2/b.bin"):
        with pytest.raises(FileNotFoundError):
            open_object(cache, REV, path)


def test_a_symlinked_data_dir_is_refused(cache, tmp_path):
    data = contract.data_dir(cache, REV)
    os.rename(data, data + ".real")
    os.symlink(data + ".real", data)
    with pytest.raises(OSError):
        open_object(cache, REV, "a.bin")


def test_a_symlinked_revision_dir_is_refused(cache, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "secret.txt").write_text("another pod's data")
    rev2 = "r-" + "f" * 20
    os.symlink(elsewhere, contract.revision_dir(cache, rev2))
    try:
        opened = open_object(cache, rev2, "secret.txt")
    except OSError:
        return
    content = read(opened)
    pytest.fail(f"served {content!r} through the symlink {contract.revision_dir(cache, rev2)} -> {elsewhere}")


def test_a_directory_or_a_missing_file_is_not_served(cache):
    for path in ("train", "a.bin/x", "missing.bin", "train/missing.bin", "missing/b.bin"):
        with pytest.raises(FileNotFoundError):
            open_object(cache, REV, path)


def test_a_fifo_is_refused_without_blocking(cache):
    fifo = os.path.join(contract.data_dir(cache, REV), "fifo")
    os.mkfifo(fifo)
    outcome: list[BaseException | object] = []

    def attempt() -> None:
        try:
            opened = open_object(cache, REV, "fifo")
            os.close(opened.fd)
            outcome.append(opened)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(2.0)
    if t.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer: the blocked open returns
        t.join(5.0)
        pytest.fail("open_object blocked on a FIFO under data/ (until the test opened it for writing)")
    assert len(outcome) == 1 and isinstance(outcome[0], FileNotFoundError), outcome


def test_staging_without_the_object_waits_then_says_staging(cache, stager_lock):
    t = time.monotonic()
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, REV, "later.bin", 0.3, _locked, Claims())
    assert e.value.state is RevisionState.STAGING
    assert time.monotonic() - t >= 0.3


def test_staging_returns_the_object_once_it_is_placed(cache, stager_lock):
    data = contract.data_dir(cache, REV)

    def place() -> None:
        time.sleep(0.2)
        tmp = os.path.join(contract.tmp_dir(cache, REV), "part")
        Path(tmp).write_bytes(b"L" * 4096)
        os.rename(tmp, os.path.join(data, "later.bin"))  # whole when it appears

    placer = threading.Thread(target=place)
    placer.start()
    t = time.monotonic()
    opened = wait_for_object(cache, REV, "later.bin", 5.0, _locked, Claims())
    placer.join()
    assert read(opened) == b"L" * 4096
    assert 0.15 <= time.monotonic() - t < 4.0


def test_a_probe_for_an_unclaimed_object_answers_at_once(cache, stager_lock):
    t = time.monotonic()
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, REV, "later.bin", 5.0, _locked, Claims(), probe=True)
    assert e.value.state is RevisionState.UNCLAIMED
    assert time.monotonic() - t < 1.0
    # A placed object is served to a probe whether claimed or not.
    assert read(wait_for_object(cache, REV, "a.bin", 5.0, _locked, Claims(), probe=True)) == b"A" * 1000


def test_a_probe_for_a_claimed_object_waits(cache, stager_lock):
    seen = Claims()
    name = claims_path(cache, REV)
    with open(name, "a") as f:
        f.write("other.bin\n")
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, REV, "dir/later bin ü", 5.0, _locked, seen, probe=True)
    assert e.value.state is RevisionState.UNCLAIMED
    with open(name, "a") as f:
        f.write("dir/later bin ")  # half a line: not a claim yet
    assert not seen.claimed(cache, REV, "dir/later bin ü")
    with open(name, "a") as f:
        f.write("ü\n")
    t = time.monotonic()
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, REV, "dir/later bin ü", 0.3, _locked, seen, probe=True)
    assert e.value.state is RevisionState.STAGING
    assert time.monotonic() - t >= 0.3
    assert seen.claimed(cache, REV, "other.bin") and not seen.claimed(cache, REV, "dir/later bin")


def test_a_relay_claim_holds_only_a_probe_that_asks_for_it(cache, stager_lock):
    """A stager taking an object from a peer says so (``/<path>``): its tree children wait for it
    (``relay``), while an owner checking whether this node reads it from the bucket does not (it
    could wait on a node that waits on it)."""
    seen = Claims()
    with open(claims_path(cache, REV), "a") as f:
        f.write(f"{RELAY_MARK}relayed.bin\n")
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, REV, "relayed.bin", 2.0, _locked, seen, probe=True)
    assert e.value.state is RevisionState.UNCLAIMED
    t = time.monotonic()
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, REV, "relayed.bin", 0.3, _locked, seen, probe=True, relay=True)
    assert e.value.state is RevisionState.STAGING and time.monotonic() - t >= 0.3


def test_relay_is_part_of_a_probe_only():
    req = ObjectRequest("team-a", "c", REV, "a.bin", 1.0, True, True)
    assert ObjectRequest.parse(req.target()) == req
    assert not ObjectRequest.parse(ObjectRequest("team-a", "c", REV, "a.bin", 1.0).target() + "&relay=1").relay


def test_claims_are_forgotten_with_their_file(cache):
    seen = Claims()
    name = claims_path(cache, REV)
    Path(name).write_text("a.bin\nb.bin\n")
    assert seen.claimed(cache, REV, "b.bin")
    os.unlink(name)
    assert not seen.claimed(cache, REV, "b.bin")
    Path(name).write_text("c.bin\n")  # a new file (a new run): read from its start
    assert seen.claimed(cache, REV, "c.bin") and not seen.claimed(cache, REV, "b.bin")


def test_a_claims_file_that_is_a_symlink_claims_nothing(cache, tmp_path):
    elsewhere = tmp_path / "claims"
    elsewhere.write_text("x.bin\n")
    os.symlink(elsewhere, claims_path(cache, REV))
    assert not Claims().claimed(cache, REV, "x.bin")


def test_a_complete_revision_without_the_file_says_absent_at_once(cache):
    Path(contract.complete_path(cache, REV)).write_text("{}")
    t = time.monotonic()
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, REV, "missing.bin", 5.0, _locked, Claims())
    assert e.value.state is RevisionState.ABSENT
    assert time.monotonic() - t < 1.0
    assert read(wait_for_object(cache, REV, "a.bin", 5.0, _locked, Claims())) == b"A" * 1000


def test_a_revision_nobody_copies_says_absent_at_once(cache):
    # Not complete, and no stager holds C's lock (the stager died): nothing will come.
    t = time.monotonic()
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, REV, "later.bin", 5.0, _locked, Claims())
    assert e.value.state is RevisionState.ABSENT and time.monotonic() - t < 1.0
    # What it placed before it died is still whole, and served.
    assert read(wait_for_object(cache, REV, "a.bin", 5.0, _locked, Claims())) == b"A" * 1000
    with pytest.raises(NotHere) as e:
        wait_for_object(cache, "r-" + "e" * 20, "a.bin", 5.0, _locked, Claims())
    assert e.value.state is RevisionState.ABSENT


def test_a_look_given_the_revisions_state_does_not_look_at_the_lock_again(cache, stager_lock):
    """A batch looks at the revision's state once, then at each object it misses (server.py
    _batch_states): the lock is not opened again per object."""

    def no_lock(c: str) -> bool:
        raise AssertionError("the lock was looked at again")

    got = poll_object(cache, REV, "later.bin", no_lock, Claims(), first=False, state=RevisionState.STAGING)
    assert isinstance(got, NotHere) and got.state is RevisionState.STAGING
    with pytest.raises(NotHere) as e:
        poll_object(cache, REV, "later.bin", no_lock, Claims(), True, False, False, RevisionState.STAGING)
    assert e.value.state is RevisionState.UNCLAIMED
    # Whole here: served whatever state the caller looked at.
    opened = poll_object(cache, REV, "a.bin", no_lock, Claims(), state=RevisionState.ABSENT)
    assert isinstance(opened, Opened) and read(opened) == b"A" * 1000

"""A node passes an object on as it comes (issue 30, dscache_contract.peers.GROW_MIN): its agent
answers a peer that gave the object's size with the bytes its stager has written so far into the
object's grow file, following the file as it grows, until it is whole; a stager that gives the file
up ends the answer short; a request without a size still waits for the whole object. And the
native peer fetcher (native/src/peer.rs) writes such a body into its own grow file as it comes,
keeping it only when it checks. A real agent server on a temp cache root (test_node_agent_held's)."""

from __future__ import annotations

import hashlib
import http.client
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import dscache_contract as contract
from dscache_contract.peers import GROW_PREFIX, GROWN_XATTR, REVISION_HEADER, ObjectRequest, grow_name
from tests.unit.test_node_agent import R1
from tests.unit.test_node_agent_held import staging  # noqa: F401 (a fixture)
from tests.unit.test_node_auth import jwt

SIZE = 600_000
PATH = "shards/s0.tar"


def grow_file(c: str, path: str = PATH) -> Path:
    tmp = Path(contract.tmp_dir(c, R1))
    tmp.mkdir(exist_ok=True)
    return tmp / grow_name(path)


def place(c: str, grow: Path) -> None:
    """As the stager places an object: renamed into data/ (the same inode)."""
    dest = Path(contract.data_dir(c, R1)) / PATH
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(grow, dest)


def ask(port: int, size: int, path: str = PATH) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request(
        "GET",
        ObjectRequest("ml", "c", R1, path, wait=4.0, probe=True, relay=True, size=size).target(),
        headers={"Authorization": f"Bearer {jwt('stager')}"},
    )
    return conn.getresponse()


def test_a_request_carries_its_size_only_with_a_probe():
    req = ObjectRequest("ml", "c", R1, PATH, 2.0, True, True, SIZE)
    assert req.target().endswith(f"&size={SIZE}")
    assert ObjectRequest.parse(req.target()) == req
    assert "size=" not in ObjectRequest("ml", "c", R1, PATH, 2.0, False, False, SIZE).target()
    for bad in ("-1", "1e6", "0x10", "١٢", "9" * 19):
        with pytest.raises(ValueError, match="size="):
            ObjectRequest.parse(f"{contract.peers.OBJECTS_PATH}ml/c/{R1}/{PATH}?wait=1&probe=1&size={bad}")
    assert grow_name(PATH).startswith(GROW_PREFIX) and grow_name(PATH) != grow_name(PATH + "x")


def test_a_body_still_growing_is_passed_on_as_it_comes(staging):  # noqa: F811
    port, c = staging
    body = os.urandom(SIZE)
    grow = grow_file(c)
    with open(grow, "wb") as f:
        f.write(body[:200_000])
        f.flush()
        resp = ask(port, SIZE)
        assert resp.status == 200 and resp.getheader(REVISION_HEADER) == R1
        assert int(resp.getheader("Content-Length")) == SIZE
        # What is written so far comes before the rest is: the agent does not wait for the whole.
        assert resp.read(200_000) == body[:200_000]
        f.write(body[200_000:])
    place(c, grow)  # placed: the same inode, followed on
    assert resp.read() == body[200_000:]


def test_a_growing_body_given_up_ends_short(staging):  # noqa: F811
    port, c = staging
    grow = grow_file(c)
    grow.write_bytes(b"x" * 100_000)
    resp = ask(port, SIZE)
    assert resp.status == 200
    assert resp.read(100_000) == b"x" * 100_000
    started = time.monotonic()
    grow.unlink()  # the stager gave it up (its source failed, or the body did not check)
    with pytest.raises(http.client.IncompleteRead):
        resp.read()
    assert time.monotonic() - started < 5  # at once, not after the stall's 30 s


def test_a_request_without_its_size_waits_for_the_whole_object(staging):  # noqa: F811
    port, c = staging
    grow = grow_file(c)
    grow.write_bytes(b"y" * 100_000)
    Path(contract.peers.claims_path(c, R1)).write_text("/" + PATH + "\n")  # taken from a peer here
    got: dict[str, tuple[int, bytes, float]] = {}

    def without_size() -> None:
        resp = ask(port, 0)
        got["answer"] = (resp.status, resp.read(), time.monotonic())

    t = threading.Thread(target=without_size, daemon=True)
    t.start()
    time.sleep(1.0)
    assert got == {}  # held: the body is not whole
    with open(grow, "ab") as f:
        f.write(b"y" * 50_000)
    placed = time.monotonic()
    place(c, grow)
    t.join(10)
    status, body, at = got["answer"]
    assert (status, body) == (200, b"y" * 150_000) and at >= placed


def test_the_native_fetcher_grows_its_own_file_as_the_body_comes(staging, tmp_path: Path):  # noqa: F811
    dscache_native = pytest.importorskip("dscache_native")
    port, c = staging
    body = os.urandom(SIZE)
    source = grow_file(c)
    source.write_bytes(body[:300_000])
    mine = tmp_path / grow_name(PATH)  # a grow file of this node: written as it comes
    fetcher = dscache_native.PeerFetcher(revision_header=REVISION_HEADER, per_peer=1)
    target = ObjectRequest("ml", "c", R1, PATH, 4.0, True, True, SIZE).target()
    outs: list = []
    t = threading.Thread(
        target=lambda: outs.extend(
            fetcher.fetch(
                f"127.0.0.1:{port}", jwt("stager"), R1, [(target, SIZE, hashlib.md5(body).hexdigest(), str(mine))]
            )
        ),
        daemon=True,
    )
    t.start()
    deadline = time.monotonic() + 10
    while not (mine.exists() and mine.stat().st_size >= 200_000) and time.monotonic() < deadline:
        time.sleep(0.02)
    so_far = mine.read_bytes()  # what came so far is there before the rest exists
    assert len(so_far) >= 200_000 and so_far == body[: len(so_far)]
    with open(source, "ab") as f:
        f.write(body[300_000:])
    t.join(15)
    assert outs == [("placed", 200, "")]
    assert mine.read_bytes() == body

    # A body that does not hash to its ETag: its grow file goes (a peer following it sees that).
    bad = tmp_path / grow_name("other")
    source.unlink()
    source.write_bytes(body)
    (out,) = fetcher.fetch(f"127.0.0.1:{port}", jwt("stager"), R1, [(target, SIZE, "0" * 32, str(bad))])
    assert out[0] == "suspect" and not bad.exists()


def test_a_held_request_follows_a_grow_file_as_soon_as_it_appears(staging):  # noqa: F811
    port, c = staging
    grow = grow_file(c)
    Path(contract.peers.claims_path(c, R1)).write_text("/" + PATH + "\n")  # taken from a peer here
    got: dict[str, Any] = {}

    def follower() -> None:
        resp = ask(port, SIZE)
        assert resp.status == 200
        got["first"] = (resp.read(100_000), time.monotonic())
        got["rest"] = resp.read()

    t = threading.Thread(target=follower, daemon=True)
    t.start()
    time.sleep(1.5)  # held past a full look (FULL_LOOK_S): it waits on the directories
    assert got == {}
    body = os.urandom(SIZE)
    with open(grow, "wb") as f:  # the stager's answer came: its grow file is created
        created = time.monotonic()
        f.write(body[:100_000])
        f.flush()
        deadline = time.monotonic() + 5
        while "first" not in got and time.monotonic() < deadline:
            time.sleep(0.01)
        first, at = got["first"]
        assert first == body[:100_000]
        # Woken by the file's creation (a full look would be up to 1 s): within a loaded CI's bound.
        assert at - created < 0.5, at - created
        f.write(body[100_000:])
    place(c, grow)
    t.join(10)
    assert got["rest"] == body[100_000:]


def test_a_grow_file_sized_first_is_passed_on_as_far_as_its_attribute_says(staging):  # noqa: F811
    port, c = staging
    body = os.urandom(SIZE)
    grow = grow_file(c)
    with open(grow, "wb") as f:  # as large.rs makes it: the attribute, then the size, then parts
        os.setxattr(f.fileno(), GROWN_XATTR, b"0")
        f.truncate(SIZE)
        f.flush()
        os.pwrite(f.fileno(), body[400_000:], 400_000)  # a later part lands first
        resp = ask(port, SIZE)
        assert resp.status == 200
        time.sleep(0.3)
        os.pwrite(f.fileno(), body[:100_000], 0)
        os.setxattr(f.fileno(), GROWN_XATTR, b"100000")
        assert resp.read(100_000) == body[:100_000]  # what the attribute says, no more
        os.pwrite(f.fileno(), body[100_000:400_000], 100_000)
        os.removexattr(f.fileno(), GROWN_XATTR)  # whole: its size says so now
    place(c, grow)
    assert resp.read() == body[100_000:]

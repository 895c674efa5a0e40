"""The listing from a peer, in pieces: the contract's request and line format, the stager's writer,
check and reader (dscache_stager.peer_listing), its client against a small HTTP peer in this
process (real connections, answers a test chooses), and the agent's file lookups
(dscache_node.listings)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dscache_contract import RevisionHasher
from dscache_contract.listings import (
    MAX_LISTING_WAIT_S,
    ListingRequest,
    listing_line,
    listing_part_path,
    listing_path,
    listing_sources,
    parse_listing_line,
)
from dscache_contract.peers import REVISION_HEADER, Peer, PeersAnswer
from dscache_node.listings import listed_so_far, open_listing
from dscache_stager import peer_listing
from dscache_stager.layout import Revision
from dscache_stager.listpage import LIST_CHUNK
from dscache_stager.peers import Peers

ME = "127.0.0.1:1"  # this node's own address: never connected to
OBJECTS = [(f"d/{i:04}.bin", i * 7 + 1, f"{i:032x}", None, False) for i in range(2500)]


def revision_of(objs: list[tuple[str, int, str, str | None, bool]]) -> str:
    h = RevisionHasher()
    for key, size, etag, version_id, _ in objs:
        h.add(key, size, etag, version_id)
    return h.revision_id()


REV = revision_of(OBJECTS)


def body_of(objs: list[tuple[str, int, str, str | None, bool]]) -> bytes:
    return "".join(listing_line(*o) for o in objs).encode()


@pytest.fixture
def rev(tmp_path: Path) -> Revision:
    r = Revision(str(tmp_path / "c"), REV)
    r.prepare()
    return r


# --- the contract ---------------------------------------------------------------------------


def test_listing_request_round_trips_and_clamps_its_wait():
    req = ListingRequest("ml", "imagenet", REV, 5)
    assert req.target() == f"/v1/listings/ml/imagenet/{REV}?wait=5"
    assert ListingRequest.parse(req.target()) == req
    assert ListingRequest.parse(f"/v1/listings/ml/c/{REV}?wait=1e9").wait == MAX_LISTING_WAIT_S
    assert ListingRequest.parse(f"/v1/listings/ml/c/{REV}?wait=nan").wait == 0.0
    for bad in (f"/v1/listings/ml/{REV}", f"/v1/listings/ml/c/{REV}/x", "/v1/listings/ml/c/r-bad", "/v1/objects/a/b"):
        with pytest.raises(ValueError):
            ListingRequest.parse(bad)


def test_listing_lines_round_trip_and_refuse_anything_else():
    for obj in (("a/b ü", 3, "e" * 32, None, False), ("k", 0, "", "v1", True)):
        assert parse_listing_line(listing_line(*obj)) == obj
    for bad in ("", "[]", '["k", -1, "e", null, false]', '["k", true, "e", null, false]', '["k", 1, 2, null, false]'):
        with pytest.raises(ValueError):
            parse_listing_line(bad)


def test_the_earliest_node_lists_and_the_others_ask_it():
    staging = [Peer("n3:1", 3.0), Peer("n1:1", 1.0), Peer(ME, 2.0), Peer("n0:1", 1.0), Peer("n4:1", 4.0)]
    # Those that started before this node, earliest first (ties by address); later ones never.
    assert listing_sources(PeersAnswer(ME, staging)) == ["n0:1", "n1:1"]
    # Each node in turn: only the earliest asks nobody, so it alone lists, whoever joins later.
    for p in staging:
        srcs = listing_sources(PeersAnswer(p.addr, staging))
        assert (srcs == []) == (p.addr == "n0:1") and (not srcs or srcs[0] == "n0:1"), (p, srcs)
    # Nodes that hold the revision whole come first; this node's own label not in the answer yet:
    # every node copying is earlier.
    got = listing_sources(PeersAnswer(ME, [Peer("n3:1", 3.0)], complete=[Peer("c1:1"), Peer("c2:1")]))
    assert sorted(got[:2]) == ["c1:1", "c2:1"] and got[2:] == ["n3:1"]


# --- the stager's writer, check and reader ---------------------------------------------------


def test_the_writer_puts_the_listing_in_place_only_when_finished(rev: Revision):
    w = peer_listing.ListingWriter(rev)
    for o in OBJECTS:
        w.add(*o)
    w.flush()
    assert os.path.getsize(listing_part_path(rev.c, rev.rev)) == len(body_of(OBJECTS))
    assert not os.path.exists(listing_path(rev.c, rev.rev))
    w.finish()
    w.abort()  # what the run's finally does: nothing once finished
    path = listing_path(rev.c, rev.rev)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o444
    assert not os.path.exists(listing_part_path(rev.c, rev.rev))
    assert peer_listing.check_file(path, REV)
    # Any one field changed: not the revision.
    os.chmod(path, 0o644)
    lie = list(OBJECTS)
    lie[100] = (lie[100][0], lie[100][1] + 1, *lie[100][2:])
    Path(path).write_bytes(body_of(lie))
    assert not peer_listing.check_file(path, REV)
    Path(path).write_bytes(b"not json\n")
    assert not peer_listing.check_file(path, REV)


def test_an_aborted_listing_leaves_nothing(rev: Revision):
    w = peer_listing.ListingWriter(rev)
    w.add(*OBJECTS[0])
    w.abort()
    assert os.listdir(rev.tmp) == []
    assert not os.path.exists(listing_path(rev.c, rev.rev))


def test_read_gives_the_listing_in_pages_in_order(tmp_path: Path):
    path = tmp_path / "listing"
    path.write_bytes(body_of(OBJECTS))

    async def pages() -> list[list[tuple[str, int, str, str | None, bool]]]:
        f = open(path, encoding="utf-8")  # noqa: SIM115 (read closes it)
        return [[(o.key, o.size, o.etag, o.version_id, o.marker) for o in page] async for page in peer_listing.read(f)]

    got = asyncio.run(pages())
    assert [len(p) for p in got] == [LIST_CHUNK, LIST_CHUNK, len(OBJECTS) - 2 * LIST_CHUNK]
    assert [o for p in got for o in p] == OBJECTS


# --- the client, against a peer in this process ----------------------------------------------


class FakeAgent:
    """Answers every listing request with ``respond(n)`` (n: the request's number, from 0)."""

    def __init__(self, respond: Callable[[int], tuple[int, bytes, dict[str, str]]]) -> None:
        self.respond = respond
        self.requests = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                n = fake.requests
                fake.requests += 1
                status, body, headers = fake.respond(n)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_agent() -> Iterator[Callable[..., FakeAgent]]:
    made: list[FakeAgent] = []

    def make(respond: Callable[[int], tuple[int, bytes, dict[str, str]]]) -> FakeAgent:
        made.append(FakeAgent(respond))
        return made[-1]

    yield make
    for a in made:
        a.close()


def peers_with(tmp_path: Path, holder: str) -> Peers:
    """This node's view: ``holder`` holds the revision whole, so it ranks first for the listing."""
    token = tmp_path / "token"
    token.write_text("a-token")
    p = Peers("http://127.0.0.1:1", "ml/c", REV, str(token))
    p.answer = PeersAnswer(me=ME, staging=[Peer(ME, 1.0)], complete=[Peer(holder)])
    return p


def listing(body: bytes, rev: str = REV) -> tuple[int, bytes, dict[str, str]]:
    return 200, body, {REVISION_HEADER: rev}


def not_yet(listed: int, state: str = "staging") -> tuple[int, bytes, dict[str, str]]:
    return 404, json.dumps({"state": state, "listed": listed}).encode(), {}


def test_a_peers_listing_that_hashes_to_the_revision_is_used_and_kept(tmp_path: Path, rev: Revision, fake_agent):
    agent = fake_agent(lambda n: not_yet(100 * (n + 1)) if n < 2 else listing(body_of(OBJECTS)))
    notes: list[str] = []
    f = peer_listing.from_peers(peers_with(tmp_path, agent.addr), rev, notes.append)
    assert f is not None
    f.close()
    assert agent.requests == 3  # asked again while the listing grew
    assert Path(listing_path(rev.c, rev.rev)).read_bytes() == body_of(OBJECTS)
    assert os.listdir(rev.tmp) == []
    assert any(f"took revision {REV}'s listing from {agent.addr}" in n for n in notes), notes


@pytest.mark.parametrize(
    "lie",
    [
        body_of(OBJECTS[:-1]),  # one object left out
        body_of([*OBJECTS[:5], ("d/extra", 1, "0" * 32, None, False), *OBJECTS[5:]]),  # one added
        body_of(OBJECTS)[:-10],  # cut short
        b"<html>not a listing</html>\n",
    ],
    ids=["missing", "added", "cut", "garbage"],
)
def test_a_peers_listing_that_does_not_hash_is_not_used(tmp_path: Path, rev: Revision, fake_agent, lie: bytes):
    agent = fake_agent(lambda n: listing(lie))
    notes: list[str] = []
    assert peer_listing.from_peers(peers_with(tmp_path, agent.addr), rev, notes.append) is None
    assert not os.path.exists(listing_path(rev.c, rev.rev))
    assert os.listdir(rev.tmp) == []
    assert any("listing the bucket" in n for n in notes), notes


def test_a_listing_for_another_revision_is_not_used(tmp_path: Path, rev: Revision, fake_agent):
    agent = fake_agent(lambda n: listing(body_of(OBJECTS), "r-" + "f" * 20))
    notes: list[str] = []
    assert peer_listing.from_peers(peers_with(tmp_path, agent.addr), rev, notes.append) is None
    assert any("does not hash to revision" in n for n in notes), notes


def test_a_peer_without_the_listing_is_given_up(tmp_path: Path, rev: Revision, fake_agent, monkeypatch):
    monkeypatch.setattr(peer_listing, "STALL_S", 0.3)
    complete = fake_agent(lambda n: not_yet(0, "complete"))
    notes: list[str] = []
    assert peer_listing.from_peers(peers_with(tmp_path, complete.addr), rev, notes.append) is None
    assert complete.requests == 1  # it holds the revision without a listing: no use waiting
    stalled = fake_agent(lambda n: not_yet(500))  # listing, but no longer growing
    assert peer_listing.from_peers(peers_with(tmp_path, stalled.addr), rev, notes.append) is None
    assert stalled.requests >= 2
    assert "no peer had" in notes[-1], notes


def test_this_node_lists_when_it_ranks_first(tmp_path: Path, rev: Revision):
    token = tmp_path / "token"
    token.write_text("a-token")
    p = Peers("http://127.0.0.1:1", "ml/c", REV, str(token))
    p.answer = PeersAnswer(me=ME, staging=[Peer(ME, 1.0)])
    assert peer_listing.from_peers(p, rev, lambda _: None) is None


def test_an_earlier_runs_listing_is_checked_before_use(tmp_path: Path, rev: Revision):
    p = peers_with(tmp_path, "127.0.0.1:9")  # unreachable: never asked when the local one is good
    path = Path(listing_path(rev.c, rev.rev))
    path.write_bytes(body_of(OBJECTS))
    f = peer_listing.from_peers(p, rev, lambda _: None)
    assert f is not None and f.name == str(path)
    f.close()
    path.write_bytes(body_of(OBJECTS[1:]))  # planted by a pod of the cache, say
    assert peer_listing.from_peers(p, rev, lambda _: None) is None
    assert not path.exists()


# --- the agent's file lookups -----------------------------------------------------------------


def test_the_agent_opens_the_whole_listing_only_through_real_directories(rev: Revision, tmp_path: Path):
    c = rev.c
    with pytest.raises(FileNotFoundError):
        open_listing(c, REV)
    assert listed_so_far(c, REV) is None
    w = peer_listing.ListingWriter(rev)
    w.add(*OBJECTS[0])
    w.flush()
    assert listed_so_far(c, REV) == len(listing_line(*OBJECTS[0]).encode())
    w.finish()
    opened = open_listing(c, REV)
    os.close(opened.fd)
    assert opened.size == len(listing_line(*OBJECTS[0]).encode())
    # A symlink in its place (everything under C is the cache's pods' to write) is not followed.
    os.chmod(rev.meta, 0o755)
    os.unlink(listing_path(c, REV))
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0\n")
    os.symlink(secret, listing_path(c, REV))
    with pytest.raises(FileNotFoundError):
        open_listing(c, REV)


# --- the lister lists ahead of its own copy (peer_listing.ahead) -----------------------------


def _pages(objs: list[tuple[str, int, str, str | None, bool]], fail: BaseException | None = None):
    from dscache_stager.objects import RemoteObject

    async def gen():
        for i in range(0, len(objs), 500):
            await asyncio.sleep(0)
            yield [RemoteObject(*o) for o in objs[i : i + 500]]
        if fail is not None:
            raise fail

    return gen()


def test_the_lister_puts_the_listing_in_place_before_its_copy_took_the_pages(rev: Revision):
    """Its peers wait for the whole listing: it is in place once listed and hashed, while the
    copy has taken one page, and what the copy takes is the listing, in order."""

    async def go() -> list[str]:
        w = peer_listing.ListingWriter(rev)
        pages = peer_listing.ahead(_pages(OBJECTS), w, REV, lambda k: k)
        got = [o.key for o in await pages.__anext__()]
        for _ in range(50):
            await asyncio.sleep(0)
        assert peer_listing.check_file(listing_path(rev.c, rev.rev), REV)  # in place already
        async for page in pages:
            got += [o.key for o in page]
        return got

    assert asyncio.run(go()) == [o[0] for o in OBJECTS]


def test_the_lister_holds_at_most_its_bound_ahead_and_never_places_a_wrong_listing(rev: Revision):
    async def bounded() -> None:
        w = peer_listing.ListingWriter(rev)
        pages = peer_listing.ahead(_pages(OBJECTS), w, REV, lambda k: k, most=1000)
        await pages.__anext__()
        for _ in range(50):
            await asyncio.sleep(0)
        # 500 taken, 1000 held: the rest not listed yet, so not in place
        assert not os.path.exists(listing_path(rev.c, rev.rev))
        assert os.path.getsize(listing_part_path(rev.c, rev.rev)) == len(body_of(OBJECTS[:1500]))
        await pages.aclose()
        w.abort()

    asyncio.run(bounded())
    assert os.listdir(rev.tmp) == []

    async def other_revision() -> None:
        w = peer_listing.ListingWriter(rev)
        async for _ in peer_listing.ahead(_pages(OBJECTS[:-1]), w, REV, lambda k: k):
            pass
        assert not os.path.exists(listing_path(rev.c, rev.rev))
        w.abort()

    asyncio.run(other_revision())


def test_a_listing_that_fails_fails_where_the_copy_takes_the_next_page(rev: Revision):
    async def go() -> int:
        w = peer_listing.ListingWriter(rev)
        n = 0
        try:
            async for page in peer_listing.ahead(_pages(OBJECTS, OSError("the bucket went away")), w, REV, lambda k: k):
                n += len(page)
        finally:
            w.abort()
        return n

    with pytest.raises(OSError, match="went away"):
        asyncio.run(go())
    assert not os.path.exists(listing_path(rev.c, rev.rev))

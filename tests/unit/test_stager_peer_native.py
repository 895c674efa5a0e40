"""The native peer fetcher (native/src/peer.rs, dscache_stager.peer_native) against small HTTP
peers in this process: real connections to a server that answers what a test tells it to (an
honest agent, or one that lies about the revision, the length or the bytes).

What must hold: only a body with the revision asked for, the manifest's length and the ETag's MD5
is ever written; every other answer comes back with what peers.py's policy needs to judge it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dscache_contract.peers import RELAY_MARK, REVISION_HEADER, Peer, PeersAnswer
from dscache_stager import peer_native
from dscache_stager.peers import Outcome, Peers

dscache_native = pytest.importorskip("dscache_native")
if not hasattr(dscache_native, "PeerFetcher"):
    pytest.skip("the installed dscache_native has no PeerFetcher (make install)", allow_module_level=True)

REV = "r-" + "0123456789abcdef0123"
BODY = os.urandom(16 << 10)
ETAG = hashlib.md5(BODY).hexdigest()

#: (status, headers, body, bytes of the body actually sent (None: all), seconds to sleep before answering)
Answer = tuple[int, dict[str, str], bytes, int | None, float]


def honest(path: str) -> Answer:
    return 200, {REVISION_HEADER: REV, "Content-Length": str(len(BODY))}, BODY, None, 0.0


class LyingPeer:
    """An agent that answers every GET with ``respond(path)``; counts requests and connections."""

    def __init__(self, respond: Callable[[str], Answer]) -> None:
        self.respond = respond
        self.requests = 0
        self.open = 0
        self.most_open = 0
        self.auth: list[str] = []
        lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with lock:
                    fake.open += 1
                    fake.most_open = max(fake.most_open, fake.open)

            def finish(self) -> None:
                with lock:
                    fake.open -= 1
                super().finish()

            def do_GET(self) -> None:
                with lock:
                    fake.requests += 1
                fake.auth.append(self.headers.get("Authorization", ""))
                status, headers, body, cut, delay = fake.respond(self.path)
                time.sleep(delay)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body if cut is None else body[:cut])
                if cut is not None:
                    self.wfile.flush()
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def peer_with() -> Iterator[Callable[[Callable[[str], Answer]], LyingPeer]]:
    made: list[LyingPeer] = []

    def make(respond: Callable[[str], Answer]) -> LyingPeer:
        made.append(LyingPeer(respond))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def fetcher(**kw: object) -> object:
    return dscache_native.PeerFetcher(revision_header=REVISION_HEADER, **kw)


def fetch_one(addr: str, tmp: Path, **kw: object) -> tuple[str, int, str]:
    (out,) = fetcher(**kw).fetch(addr, "tok", REV, [("/v1/objects/a/b/c/x", len(BODY), ETAG, str(tmp))])
    return out


def test_an_honest_body_is_written_read_only(peer_with, tmp_path: Path):
    p = peer_with(honest)
    kind, code, _ = fetch_one(p.addr, tmp_path / "t")
    assert (kind, code) == ("placed", 200)
    assert (tmp_path / "t").read_bytes() == BODY
    assert (tmp_path / "t").stat().st_mode & 0o777 == 0o444
    assert p.auth == ["Bearer tok"]


@pytest.mark.parametrize(
    ("lie", "kind"),
    [
        ({REVISION_HEADER: "r-" + "f" * 20, "Content-Length": str(len(BODY))}, "lied"),
        ({"Content-Length": str(len(BODY))}, "lied"),  # no revision header at all
        ({REVISION_HEADER: REV, "Content-Length": str(len(BODY) - 1)}, "lied"),
        ({REVISION_HEADER: REV, "Content-Length": str(len(BODY) + 1)}, "lied"),
    ],
)
def test_a_wrong_revision_or_length_writes_nothing(peer_with, tmp_path: Path, lie: dict[str, str], kind: str):
    body = BODY + b"x" if lie.get("Content-Length") == str(len(BODY) + 1) else BODY
    p = peer_with(lambda path: (200, lie, body[: int(lie["Content-Length"])], None, 0.0))
    got_kind, code, detail = fetch_one(p.addr, tmp_path / "t")
    assert (got_kind, code) == (kind, 200), detail
    assert not (tmp_path / "t").exists()


def test_wrong_bytes_of_the_right_length_are_suspect_and_not_written(peer_with, tmp_path: Path):
    lie = bytes(b ^ 0xFF for b in BODY)
    p = peer_with(lambda path: (200, {REVISION_HEADER: REV, "Content-Length": str(len(lie))}, lie, None, 0.0))
    kind, _, md5 = fetch_one(p.addr, tmp_path / "t")
    assert (kind, md5) == ("suspect", hashlib.md5(lie).hexdigest())
    assert not (tmp_path / "t").exists()


def test_a_body_cut_short_writes_nothing(peer_with, tmp_path: Path):
    headers = {REVISION_HEADER: REV, "Content-Length": str(len(BODY))}
    p = peer_with(lambda path: (200, headers, BODY, len(BODY) // 2, 0.0))
    kind, _, _ = fetch_one(p.addr, tmp_path / "t")
    assert kind == "transport"
    assert not (tmp_path / "t").exists()


def test_a_silent_peer_is_stalled(peer_with, tmp_path: Path):
    p = peer_with(lambda path: (*honest(path)[:4], 1.5))
    kind, _, _ = fetch_one(p.addr, tmp_path / "t", answer_timeout_s=0.3)
    assert kind == "stalled"
    assert not (tmp_path / "t").exists()


def test_non_200_answers_carry_their_state(peer_with, tmp_path: Path):
    text = b'{"state": "staging", "error": "in flight"}'
    p = peer_with(lambda path: (404, {"Content-Length": str(len(text))}, text, None, 0.0))
    assert fetch_one(p.addr, tmp_path / "t") == ("status", 404, "staging")
    q = peer_with(lambda path: (429, {"Content-Length": "2"}, b"{}", None, 0.0))
    assert fetch_one(q.addr, tmp_path / "u") == ("status", 429, "")


def test_no_connection_is_refused(tmp_path: Path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    kind, _, _ = fetch_one(f"127.0.0.1:{port}", tmp_path / "t")
    assert kind == "refused"


def test_a_batch_keeps_to_per_peer_connections(peer_with, tmp_path: Path):
    p = peer_with(lambda path: (*honest(path)[:4], 0.02))
    items = [("/v1/objects/a/b/c/x", len(BODY), ETAG, str(tmp_path / f"t{i}")) for i in range(60)]
    outs = fetcher(per_peer=3).fetch(p.addr, "tok", REV, items)
    assert [k for k, _, _ in outs] == ["placed"] * 60
    assert p.requests == 60
    assert 1 <= p.most_open <= 3, p.most_open


# --- peer_native.NativePeers: the answers as peers.py's policy reads them ----------------------


def peers_of(tmp_path: Path, addrs: list[str]) -> Peers:
    token = tmp_path / "token"
    token.write_text("tok")
    p = Peers("127.0.0.1:1", "ns/cache", REV, str(token))
    p.answer = PeersAnswer(me="127.0.0.1:1", complete=[Peer(a) for a in addrs])
    return p


def native_peers(tmp_path: Path, addrs: list[str]) -> peer_native.NativePeers:
    return peer_native.NativePeers(dscache_native, peers_of(tmp_path, addrs))


def first(np: peer_native.NativePeers, addr: str, tmp_path: Path, n: int = 1):
    seq = iter(range(1000))
    claims: list[str] = []
    wants = [(f"k{i}", f"d/{i}", len(BODY), ETAG) for i in range(n)]
    got = np.first(addr, wants, lambda: str(tmp_path / f"peer-{next(seq)}"), claims.append)
    return got, claims


def test_native_peers_place_and_claim_relays(peer_with, tmp_path: Path):
    p = peer_with(honest)
    np = native_peers(tmp_path, [p.addr])
    got, claims = first(np, p.addr, tmp_path, 3)
    assert [g.outcome if g else None for g in got] == [Outcome.PLACED] * 3
    assert all(Path(g.tmp).read_bytes() == BODY for g in got if g)
    lines = "".join(c + "\n" for c in claims).splitlines()  # as sync._relay_claim appends them
    assert len(claims) == 1 and len(lines) == 3
    assert all(line == RELAY_MARK + f"d/{i}" for i, line in enumerate(lines))
    assert np.peers.failed == {}


def test_native_peers_write_off_a_peer_that_lies_about_the_revision(peer_with, tmp_path: Path):
    lie = {REVISION_HEADER: "r-" + "e" * 20, "Content-Length": str(len(BODY))}
    p = peer_with(lambda path: (200, lie, BODY, None, 0.0))
    np = native_peers(tmp_path, [p.addr])
    got, _ = first(np, p.addr, tmp_path, 2)
    assert got == [None, None]  # back to peers.obtain, which asks the next node or the bucket
    assert p.addr in np.peers.failed and "do not match" in np.peers.failed[p.addr]
    assert list(tmp_path.glob("peer-*")) == []


def test_native_peers_send_a_suspect_body_to_the_bucket_with_its_md5(peer_with, tmp_path: Path):
    lie = bytes(b ^ 1 for b in BODY)
    p = peer_with(lambda path: (200, {REVISION_HEADER: REV, "Content-Length": str(len(lie))}, lie, None, 0.0))
    np = native_peers(tmp_path, [p.addr])
    (got,), _ = first(np, p.addr, tmp_path)
    assert got is not None and got.outcome is Outcome.BUCKET
    assert got.suspect == (p.addr, hashlib.md5(lie).hexdigest())
    assert np.peers.failed == {}  # the bucket's copy decides (Peers.judge)
    assert list(tmp_path.glob("peer-*")) == []


def test_native_peers_read_non_200_answers_as_peers_py_does(peer_with, tmp_path: Path):
    p = peer_with(lambda path: (403, {"Content-Length": "2"}, b"{}", None, 0.0))
    np = native_peers(tmp_path, [p.addr])
    (got,), _ = first(np, p.addr, tmp_path)
    assert got is None and "refused this pod's token" in np.peers.failed[p.addr]


def test_only_small_plain_md5_objects_go_native(tmp_path: Path):
    np = native_peers(tmp_path, ["127.0.0.1:2"])
    assert np.route("k", ETAG, 100) == ["127.0.0.1:2"]
    assert np.route("k", f"{ETAG}-3", 20 << 20) == []  # multipart: peers.py rebuilds it
    assert np.route("k", ETAG, 2 << 20) == []  # large
    assert np.route("k", ETAG, 0) == []


def test_ask_on_the_event_loop_places_and_tells_still_copying_apart(peer_with, tmp_path: Path):
    """NativePeers.ask (no thread waits on the call): the same outcomes as first; a 404 "staging"
    after the held request is WAIT (sync asks the chain again natively), and the hold asked for
    is sent (a peer's patience nearly spent)."""
    staging = b'{"state": "staging"}'
    seen: list[str] = []

    def respond(path: str) -> Answer:
        seen.append(path)
        if "/d/0" in path:
            return honest(path)
        return 404, {"Content-Length": str(len(staging))}, staging, None, 0.0

    p = peer_with(respond)
    np = native_peers(tmp_path, [p.addr])
    seq = iter(range(1000))
    claims: list[str] = []
    wants = [(f"k{i}", f"d/{i}", len(BODY), ETAG) for i in range(2)]

    async def go() -> list[object]:
        try:
            return await np.ask(p.addr, wants, lambda: str(tmp_path / f"peer-{next(seq)}"), claims.append, [5.0, 0.5])
        finally:
            np.close()

    placed, waiting = asyncio.run(go())
    assert placed is not None and placed.outcome is Outcome.PLACED and Path(placed.tmp).read_bytes() == BODY
    assert waiting is not None and waiting.outcome is Outcome.WAIT
    assert claims == [f"{RELAY_MARK}d/0\n{RELAY_MARK}d/1"] and np.peers.failed == {}
    assert np.placed == 1 and np.calls == 1
    assert sorted("wait=0.5" in path for path in seen) == [False, True]


def test_many_asks_at_once_each_get_their_own_outcomes(peer_with, tmp_path: Path):
    p = peer_with(honest)
    np = native_peers(tmp_path, [p.addr])
    seq = iter(range(1000))

    async def go() -> list[list[object]]:
        asks = [
            np.ask(p.addr, [(f"k{i}", f"d/{i}", len(BODY), ETAG)], lambda: str(tmp_path / f"peer-{next(seq)}"), None)
            for i in range(20)
        ]
        try:
            return await asyncio.gather(*asks)
        finally:
            np.close()

    got = asyncio.run(go())
    assert [len(g) for g in got] == [1] * 20
    assert all(o is not None and o.outcome is Outcome.PLACED for (o,) in got)
    assert len({o.tmp for (o,) in got}) == 20 and np.calls == 20

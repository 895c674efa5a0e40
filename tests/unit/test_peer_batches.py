"""The agents' batch path (POST /v1/objects-batch, issue 30): many small objects in one answer.

The agent's side on a real agent server (a cache root in a temp dir; the API server is
test_node_agent_review's fake): each object whole there comes byte-exact in its frame, the others
with their states, a refused path refused, nothing without the cache's token. The stager's side
(native/src/peer.rs) against the real agent, and against small fakes that lie in a batch answer
(the revision, a length, the bytes) or have no batch path: a body is written only when it checks,
as when asked alone, and what a batch does not carry is asked alone.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract.peers import (
    BATCH_OBJECT_MAX,
    OBJECTS_BATCH_PATH,
    REVISION_HEADER,
    ObjectRequest,
    ObjectsBatchRequest,
)
from dscache_node.server import make_server
from tests.support.s3server import free_port
from tests.unit.test_node_agent import R1, stage
from tests.unit.test_node_agent_review import gate, make_agent
from tests.unit.test_node_auth import jwt

SIZES = [1, 4096, 16 << 10, BATCH_OBJECT_MAX, BATCH_OBJECT_MAX + 1]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[int, dict[str, bytes]]]:
    """An agent serving a complete revision of ml/c holding one file per size in SIZES."""
    root = tmp_path / "root"
    root.mkdir()
    agent, _ = make_agent(root)
    c = stage(root, "ml", "c", R1, 10)
    data = Path(contract.data_dir(c, R1))
    (data / "d").mkdir()
    files = {f"d/f{n}": os.urandom(n) for n in SIZES}
    for name, body in files.items():
        (data / name).write_bytes(body)
    port = free_port()
    srv = make_server(agent, gate(), port, addr="127.0.0.1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield port, files
    finally:
        srv.shutdown()
        srv.server_close()


def frames(body: bytes) -> list[tuple[int, str, bytes]]:
    """(status, state, bytes) per frame of a batch answer; the answer must end with the last."""
    out, at = [], 0
    while at < len(body):
        end = body.index(b"\n", at)
        code, length, state = body[at:end].decode().split(" ", 2)
        start = end + 1
        out.append((int(code), state, body[start : start + int(length)]))
        at = start + int(length)
    assert at == len(body)
    return out


def post(port: int, paths: list[str], token: str | None = None) -> tuple[int, str | None, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        body = ObjectsBatchRequest("ml", "c", R1, tuple(paths)).to_json()
        headers = {"Authorization": f"Bearer {token or jwt('stager')}", "Content-Type": "application/json"}
        conn.request("POST", OBJECTS_BATCH_PATH, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader(REVISION_HEADER), resp.read()
    finally:
        conn.close()


def test_a_batch_carries_each_small_object_whole_and_says_why_not_for_the_rest(served):
    port, files = served
    small = [n for n in files if len(files[n]) <= BATCH_OBJECT_MAX]
    large = f"d/f{BATCH_OBJECT_MAX + 1}"
    status, rev, body = post(port, [*small, "d/missing", large, "../etc/passwd", small[0]])
    assert status == 200 and rev == R1
    got = frames(body)
    assert [(c, b) for c, _, b in got[: len(small)]] == [(200, files[n]) for n in small]
    # the revision is complete here: a missing object will not come
    assert got[len(small)][:2] == (404, "absent")
    assert got[len(small) + 1][:2] == (413, "")  # larger than a batch carries: asked alone
    assert got[len(small) + 2][0] == 400
    assert got[-1] == (200, "", files[small[0]])


def test_a_batch_without_the_caches_token_gets_no_byte(served):
    port, files = served
    status, _, body = post(port, ["d/f4096"], token="not-a-token")
    assert status == 401 and files["d/f4096"] not in body


@pytest.mark.parametrize("paths", [[], ["x"] * 65])
def test_a_batch_of_no_path_or_too_many_is_refused(served, paths):
    port, _ = served
    status, _, body = post(port, paths)
    assert status == 400, body


def native() -> object:
    dscache_native = pytest.importorskip("dscache_native")
    if not hasattr(dscache_native, "PeerFetcher"):
        pytest.skip("the installed dscache_native has no PeerFetcher (make install)")
    return dscache_native


def requests_by_route(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out: dict[str, float] = {}
    for m in re.finditer(r"^dscache_node_requests_total\{([^}]*)\} (\S+)$", text, re.M):
        route = re.search(r'route="([^"]*)"', m.group(1))
        if route:
            out[route.group(1)] = out.get(route.group(1), 0.0) + float(m.group(2))
    return out


def test_the_native_fetcher_takes_a_batch_from_a_real_agent_in_one_request(served, tmp_path: Path):
    dscache_native = native()
    port, files = served
    f = dscache_native.PeerFetcher(revision_header=REVISION_HEADER, per_peer=2)  # type: ignore[attr-defined]
    names = sorted(files) * 2
    items = [
        (
            ObjectRequest("ml", "c", R1, n, 1.0, True, True).target(),
            len(files[n]),
            hashlib.md5(files[n]).hexdigest(),
            str(tmp_path / f"t{i}"),
        )
        for i, n in enumerate(names)
    ]
    before = requests_by_route(port)
    outs = f.fetch(f"127.0.0.1:{port}", jwt("stager"), R1, items, ("ml", "c", names))
    assert [k for k, _, _ in outs] == ["placed"] * len(items), outs
    for i, n in enumerate(names):
        assert (tmp_path / f"t{i}").read_bytes() == files[n]
    after = requests_by_route(port)
    # one batch for the 8 small ones; the 2 larger than a batch carries, alone
    assert after.get("objects_batch", 0) - before.get("objects_batch", 0) == 1
    assert after.get("objects_probe", 0) - before.get("objects_probe", 0) == 2


# --- the stager's side against fakes ------------------------------------------------------------

REV = "r-" + "0123456789abcdef0123"
BODY = os.urandom(16 << 10)
ETAG = hashlib.md5(BODY).hexdigest()

#: (status, headers, body) of the batch answer, given the paths asked for.
BatchAnswer = tuple[int, dict[str, str], bytes]


class BatchPeer:
    """A fake agent: POSTs to the batch path answered ``batch(paths)``; GETs (objects alone) the
    honest BODY. Counts both."""

    def __init__(self, batch: Callable[[list[str]], BatchAnswer]) -> None:
        self.posts = 0
        self.gets = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                fake.posts += 1
                n = int(self.headers.get("Content-Length") or 0)
                paths = json.loads(self.rfile.read(n))["paths"]
                status, headers, body = batch(paths)
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                fake.gets += 1
                self.send_response(200)
                self.send_header(REVISION_HEADER, REV)
                self.send_header("Content-Length", str(len(BODY)))
                self.end_headers()
                self.wfile.write(BODY)

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
def batch_peer() -> Iterator[Callable[[Callable[[list[str]], BatchAnswer]], BatchPeer]]:
    made: list[BatchPeer] = []

    def make(batch: Callable[[list[str]], BatchAnswer]) -> BatchPeer:
        made.append(BatchPeer(batch))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def frame(code: int, body: bytes = b"", state: str = "") -> bytes:
    return b"%d %d %s\n" % (code, len(body), state.encode()) + body


def fetch(addr: str, tmp: Path, n: int = 3) -> list[tuple[str, int, str]]:
    f = native().PeerFetcher(revision_header=REVISION_HEADER)  # type: ignore[attr-defined]
    items = [(f"/v1/objects/a/b/{REV}/x{i}?probe=1&relay=1", len(BODY), ETAG, str(tmp / f"t{i}")) for i in range(n)]
    return list(f.fetch(addr, "tok", REV, items, ("a", "b", [f"x{i}" for i in range(n)])))


def test_a_batch_body_that_does_not_hash_is_suspect_and_not_written(batch_peer, tmp_path: Path):
    wrong = bytes(len(BODY))
    p = batch_peer(lambda paths: (200, {REVISION_HEADER: REV}, frame(200, BODY) + frame(200, wrong) + frame(200, BODY)))
    outs = fetch(p.addr, tmp_path)
    assert [k for k, _, _ in outs] == ["placed", "suspect", "placed"]
    assert outs[1][2] == hashlib.md5(wrong).hexdigest()
    assert not (tmp_path / "t1").exists()
    assert (tmp_path / "t0").read_bytes() == BODY and p.gets == 0


def test_a_batch_of_another_revision_or_length_is_a_lie(batch_peer, tmp_path: Path):
    p = batch_peer(lambda paths: (200, {REVISION_HEADER: "r-other"}, b"".join(frame(200, BODY) for _ in paths)))
    assert [k for k, _, _ in fetch(p.addr, tmp_path)] == ["lied"] * 3
    short = BODY[:-1]
    q = batch_peer(lambda paths: (200, {REVISION_HEADER: REV}, frame(200, BODY) + frame(200, short) + frame(200, BODY)))
    (tmp_path / "q").mkdir()
    outs = fetch(q.addr, tmp_path / "q")
    assert [k for k, _, _ in outs] == ["placed", "lied", "placed"], outs
    assert not list(tmp_path.glob("t*")) and not (tmp_path / "q" / "t1").exists()


def test_what_a_batch_does_not_carry_is_asked_alone_but_unclaimed(batch_peer, tmp_path: Path):
    p = batch_peer(
        lambda paths: (
            200,
            {REVISION_HEADER: REV},
            frame(404, state="staging") + frame(404, state="unclaimed") + frame(413),
        )
    )
    outs = fetch(p.addr, tmp_path)
    assert outs == [("placed", 200, ""), ("status", 404, "unclaimed"), ("placed", 200, "")]
    assert p.gets == 2


def test_an_agent_without_the_batch_path_is_asked_alone_after_one_try(batch_peer, tmp_path: Path):
    p = batch_peer(lambda paths: (404, {}, b'{"error": "no such path"}'))
    f = native().PeerFetcher(revision_header=REVISION_HEADER)  # type: ignore[attr-defined]
    for r in range(3):
        items = [(f"/v1/objects/a/b/{REV}/x{i}", len(BODY), ETAG, str(tmp_path / f"{r}-{i}")) for i in range(2)]
        outs = f.fetch(p.addr, "tok", REV, items, ("a", "b", ["x0", "x1"]))
        assert [k for k, _, _ in outs] == ["placed", "placed"]
    assert p.posts == 1 and p.gets == 6


def test_a_batch_answer_that_does_not_parse_writes_nothing(batch_peer, tmp_path: Path):
    p = batch_peer(lambda paths: (200, {REVISION_HEADER: REV}, frame(200, BODY) + b"garbage\n"))
    outs = fetch(p.addr, tmp_path)
    assert outs[0][0] == "placed" and [k for k, _, _ in outs[1:]] == ["lied", "lied"]
    assert not (tmp_path / "t1").exists() and not (tmp_path / "t2").exists()


def test_an_object_placed_is_told_at_once_not_with_the_slowest_of_its_call(batch_peer, tmp_path: Path):
    """NativePeers.ask's ``placed``: the object the batch carried comes while the other one, held
    alone at the peer (still copying), has not; the call returns once both have an outcome."""
    import asyncio
    import time

    from dscache_stager.peers import Outcome
    from tests.unit.test_stager_peer_native import native_peers

    p = batch_peer(lambda paths: (200, {REVISION_HEADER: REV}, frame(200, BODY) + frame(404, state="staging")))
    slow = p.server.RequestHandlerClass.do_GET

    def held(self: BaseHTTPRequestHandler) -> None:
        time.sleep(1.5)  # the held request: the peer places it a while later
        slow(self)

    p.server.RequestHandlerClass.do_GET = held  # type: ignore[method-assign]
    np = native_peers(tmp_path, [p.addr])
    seq = iter(range(100))
    wants = [(f"k{i}", f"d/{i}", len(BODY), ETAG) for i in range(2)]
    told: list[tuple[int, float]] = []

    async def go() -> tuple[list[object], float]:
        t0 = time.monotonic()
        try:
            got = await np.ask(
                p.addr, wants, lambda: str(tmp_path / f"peer-{next(seq)}"), None, None,
                lambda i, tmp: told.append((i, time.monotonic() - t0)),
            )  # fmt: skip
            return got, time.monotonic() - t0
        finally:
            np.close()

    got, took = asyncio.run(go())
    assert [i for i, _ in told] == [0, 1]
    assert told[0][1] < 1.0 <= took, (told, took)
    assert all(g is not None and g.outcome is Outcome.PLACED for g in got)  # type: ignore[attr-defined]
    assert p.posts == 1 and p.gets == 1

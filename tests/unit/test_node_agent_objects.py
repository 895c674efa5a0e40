"""The agent's GET /v1/objects answers (issue 30): small bodies in one write with their headers,
larger ones by sendfile, both byte-exact with the revision header and the file's length; and the
native peer fetcher (native/src/peer.rs) taking them from a real agent over kept-alive connections.
A real agent server on a cache root in a temp dir; the API server is test_node_agent_review's fake."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract.peers import REVISION_HEADER, ObjectRequest
from dscache_node.server import SMALL_BODY, make_server
from tests.support.s3server import free_port
from tests.unit.test_node_agent import R1, stage
from tests.unit.test_node_agent_review import gate, make_agent
from tests.unit.test_node_auth import jwt

SIZES = [1, 4096, SMALL_BODY - 1, SMALL_BODY, SMALL_BODY + 1, 1 << 20]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[int, dict[str, bytes]]]:
    """An agent serving a complete revision of ml/c holding one file per size in SIZES."""
    root = tmp_path / "root"
    root.mkdir()
    agent, _ = make_agent(root)
    c = stage(root, "ml", "c", R1, 10)
    data = Path(contract.data_dir(c, R1))
    files = {f"f{n}": os.urandom(n) for n in SIZES}
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


def target(name: str) -> str:
    return ObjectRequest("ml", "c", R1, name).target()


def test_small_and_large_bodies_are_exact_on_one_connection(served):
    port, files = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for _ in range(2):  # each kept alive for the next: every answer ended where it said
            for name, body in files.items():
                conn.request("GET", target(name), headers={"Authorization": f"Bearer {jwt('stager')}"})
                resp = conn.getresponse()
                got = resp.read()
                assert resp.status == 200, (name, got[:200])
                assert resp.getheader(REVISION_HEADER) == R1
                assert resp.getheader("Content-Length") == str(len(body))
                assert got == body, name
    finally:
        conn.close()


def test_serving_leaves_no_descriptor_open(served):
    """Every object served closes its file (a leak ran a 100,000-object bench's agents out of
    descriptors: EMFILE, then "absent" answers, and every peer written off)."""
    port, files = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def serve(n: int) -> None:
        for _ in range(n):
            for name in files:
                conn.request("GET", target(name), headers={"Authorization": f"Bearer {jwt('stager')}"})
                resp = conn.getresponse()
                assert resp.status == 200
                resp.read()

    try:
        serve(1)  # the first requests open what stays open (the token check, the loop's own)
        before = len(os.listdir("/proc/self/fd"))
        serve(20)
        assert len(os.listdir("/proc/self/fd")) - before < 5
    finally:
        conn.close()


def test_a_small_object_without_the_token_is_refused(served):
    port, files = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        # 4 KiB of random bytes: a 1-byte object's one byte may well appear in the error message.
        conn.request("GET", target("f4096"))
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 401 and files["f4096"] not in body
        assert "token" in json.loads(body)["error"], body
    finally:
        conn.close()


def test_the_native_fetcher_takes_them_from_a_real_agent(served, tmp_path: Path):
    dscache_native = pytest.importorskip("dscache_native")
    if not hasattr(dscache_native, "PeerFetcher"):
        pytest.skip("the installed dscache_native has no PeerFetcher")
    port, files = served
    f = dscache_native.PeerFetcher(revision_header=REVISION_HEADER, per_peer=2)
    names = sorted(files) * 3
    items = [
        (target(n), len(files[n]), hashlib.md5(files[n]).hexdigest(), str(tmp_path / f"t{i}"))
        for i, n in enumerate(names)
    ]
    outs = f.fetch(f"127.0.0.1:{port}", jwt("stager"), R1, items)
    assert [k for k, _, _ in outs] == ["placed"] * len(items), outs
    for i, n in enumerate(names):
        assert (tmp_path / f"t{i}").read_bytes() == files[n]
    # The revision asked for is not the one served: nothing written.
    other = "r-" + "9" * 20
    (kind, code, _), *_ = f.fetch(f"127.0.0.1:{port}", jwt("stager"), other, [(*items[0][:3], str(tmp_path / "x"))])
    assert (kind, code) == ("lied", 200)
    assert not (tmp_path / "x").exists()


def test_the_native_fetcher_checks_the_agents_certificate(tmp_path: Path):
    """TLS as the chart serves it: one certificate naming AGENT_TLS_NAME, the agent reached by IP.
    The fetcher trusts the agents' CA only: another CA's agent gets no request (no token sent)."""
    dscache_native = pytest.importorskip("dscache_native")
    if not hasattr(dscache_native, "PeerFetcher"):
        pytest.skip("the installed dscache_native has no PeerFetcher")
    from dscache_contract.peers import AGENT_TLS_NAME
    from dscache_node.server import tls_context
    from tests.support.tlscerts import agent_certs

    root = tmp_path / "root"
    root.mkdir()
    agent, _ = make_agent(root)
    stage(root, "ml", "c", R1, 1000)
    ca, cert, key = agent_certs(tmp_path / "pki")
    port = free_port()
    srv = make_server(agent, gate(), port, addr="127.0.0.1", tls=tls_context(str(cert), str(key)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    item = (target("blob"), 1000, hashlib.md5(b"x" * 1000).hexdigest(), str(tmp_path / "t"))
    try:
        good = dscache_native.PeerFetcher(
            revision_header=REVISION_HEADER, ca_pem=ca.read_text(), tls_name=AGENT_TLS_NAME
        )
        assert good.fetch(f"127.0.0.1:{port}", jwt("stager"), R1, [item])[0][0] == "placed"
        assert (tmp_path / "t").read_bytes() == b"x" * 1000
        other_ca, _, _ = agent_certs(tmp_path / "other")
        bad = dscache_native.PeerFetcher(
            revision_header=REVISION_HEADER, ca_pem=other_ca.read_text(), tls_name=AGENT_TLS_NAME
        )
        kind, _, detail = bad.fetch(f"127.0.0.1:{port}", jwt("stager"), R1, [(*item[:3], str(tmp_path / "u"))])[0]
        assert kind in ("transport", "refused"), (kind, detail)
        assert not (tmp_path / "u").exists()
    finally:
        srv.shutdown()
        srv.server_close()


def place(c: str, name: str, body: bytes) -> None:
    """An object placed as a stager places it: whole once its name appears (temp + rename). Written in
    place, a held request woken by the name's creation (arrivals.py) could read it still empty."""
    tmp = Path(contract.tmp_dir(c, R1)) / f".{name}.part"
    tmp.write_bytes(body)
    os.rename(tmp, Path(contract.data_dir(c, R1)) / name)


def test_probes_are_answered_alike_on_the_loop_and_on_a_thread(tmp_path: Path):
    """A copy in progress (its lock held, a claims file): a probe for an unclaimed object is answered
    "unclaimed" at once, one for a claimed object waits for it; whether the look was made on the
    loop (the claims grew by little) or on a thread (first seen, or grown by LOOP_CLAIMS_BYTES)."""
    import fcntl
    import json
    import time

    from dscache_contract.peers import claims_path
    from dscache_node import server as server_mod

    root = tmp_path / "root"
    root.mkdir()
    agent, _ = make_agent(root)
    c = stage(root, "ml", "c", R1, 10)
    os.unlink(contract.complete_path(c, R1))  # in progress, not complete
    os.makedirs(contract.tmp_dir(c, R1), exist_ok=True)
    claims = Path(claims_path(c, R1))
    claims.write_text("")
    lock = os.open(contract.lock_path(c), os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    port = free_port()
    srv = make_server(agent, gate(), port, addr="127.0.0.1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def probe(name: str, wait: float) -> tuple[int, str]:
        path = ObjectRequest("ml", "c", R1, name, wait, True).target()
        conn.request("GET", path, headers={"Authorization": f"Bearer {jwt('stager')}"})
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, (json.loads(body).get("state", "") if resp.status == 404 else body.decode())

    try:
        on_loop: list[bool] = []
        decide = srv._look_on_loop
        srv._look_on_loop = lambda *a: on_loop.append(decide(*a)) or on_loop[-1]  # type: ignore[method-assign]
        assert probe("nobody", 0.5) == (404, "unclaimed")  # first look at these claims: a thread
        assert probe("nobody", 0.5) == (404, "unclaimed")  # grown by nothing: the loop
        with claims.open("a") as f:
            f.write("x" * server_mod.LOOP_CLAIMS_BYTES + "\nsoon\n")
        placed = threading.Timer(0.3, lambda: place(c, "soon", b"hello"))
        placed.start()
        t0 = time.monotonic()
        assert probe("soon", 5.0) == (200, "hello")  # claimed: held until it is there (a thread)
        assert time.monotonic() - t0 >= 0.25
        with claims.open("a") as f:
            f.write("later\n")
        placed = threading.Timer(0.3, lambda: place(c, "later", b"again"))
        placed.start()
        assert probe("later", 5.0) == (200, "again")  # the same, looked at on the loop
        assert probe("nobody", 0.5) == (404, "unclaimed")
        assert on_loop[:2] == [False, True] and False in on_loop[2:] and on_loop[-1] is True
    finally:
        conn.close()
        srv.shutdown()
        srv.server_close()
        os.close(lock)


def test_a_shutdown_before_the_loop_starts_stops_it_cleanly(tmp_path: Path) -> None:
    """shutdown and server_close before the serving thread has started its loop (a loaded machine,
    a short test): serve_forever then returns at once, and never serves the closed socket (it
    raised "Bad file descriptor" in its thread, seen in CI)."""
    root = tmp_path / "root"
    root.mkdir()
    agent, _ = make_agent(root)
    srv = make_server(agent, gate(), free_port(), addr="127.0.0.1")
    srv.shutdown()  # returns at once: nothing to wait for
    srv.server_close()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            srv.serve_forever()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and not errors, errors

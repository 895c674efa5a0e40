"""Held object requests wake when their object is placed (arrivals.py, issue 30), not on a poll:
the inotify wake-up itself, and a real agent server answering a held request soon after the object
(and the directory it is in) appear, while the other held requests keep waiting."""

from __future__ import annotations

import asyncio
import fcntl
import http.client
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract.peers import ObjectRequest
from dscache_node.arrivals import Arrivals
from dscache_node.server import make_server
from tests.support.s3server import free_port
from tests.unit.test_node_agent import R1
from tests.unit.test_node_agent_review import gate, make_agent
from tests.unit.test_node_auth import jwt


def test_a_name_placed_in_a_watched_directory_wakes_its_waiter_only(tmp_path: Path):
    async def main() -> None:
        arrivals = Arrivals(asyncio.get_running_loop())
        if not arrivals.working:
            pytest.skip("no inotify instance available here")
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            got_x, got_y = arrivals.expect(fd, "x"), arrivals.expect(fd, "y")
            assert got_x is not None and got_y is not None
            (tmp_path / "x.tmp").write_bytes(b"1")
            os.rename(tmp_path / "x.tmp", tmp_path / "x")  # as the stager places an object
            await asyncio.wait_for(got_x[0], 2.0)
            await asyncio.sleep(0.1)
            assert not got_y[0].done()  # another name: still waiting
            os.mkdir(tmp_path / "y")  # a directory on a waiter's way counts too
            await asyncio.wait_for(got_y[0], 2.0)
            got_x[1]()
            got_y[1]()
        finally:
            os.close(fd)
            arrivals.close()

    asyncio.run(main())


@pytest.fixture
def staging(tmp_path: Path) -> Iterator[tuple[int, str]]:
    """An agent whose node's stager is copying R1 of ml/c (C's lock held, data/ there, nothing placed)."""
    root = tmp_path / "root"
    root.mkdir()
    agent, _ = make_agent(root)
    c = contract.cache_dir(str(root), "ml", "c")
    os.makedirs(contract.data_dir(c, R1))
    lock = os.open(contract.lock_path(c), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    port = free_port()
    srv = make_server(agent, gate(), port, addr="127.0.0.1")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield port, c
    finally:
        srv.shutdown()
        srv.server_close()
        os.close(lock)


def held(port: int, path: str, out: dict[str, tuple[int, float, bytes]]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "GET",
            ObjectRequest("ml", "c", R1, path, wait=4.0).target(),
            headers={"Authorization": f"Bearer {jwt('stager')}"},
        )
        resp = conn.getresponse()
        out[path] = (resp.status, time.monotonic(), resp.read())
    finally:
        conn.close()


def test_a_held_request_is_answered_soon_after_its_object_is_placed(staging):
    port, c = staging
    data = Path(contract.data_dir(c, R1))
    out: dict[str, tuple[int, float, bytes]] = {}
    names = ["sub/deeper/a.bin", "b.bin", "never.bin"]
    threads = [threading.Thread(target=held, args=(port, n, out), daemon=True) for n in names]
    for t in threads:
        t.start()
    time.sleep(1.5)  # held past a full look (FULL_LOOK_S): the requests wait on their directories
    assert out == {}
    placed = {}
    (data / "sub" / "deeper").mkdir(parents=True)  # the directories come first, then the file
    for name, body in (("sub/deeper/a.bin", b"A" * 100), ("b.bin", b"B" * 70_000)):
        tmp = data / (name + ".tmp")
        tmp.write_bytes(body)
        os.rename(tmp, data / name)
        placed[name] = time.monotonic()
    for t in threads[:2]:
        t.join(5)
    for name, size in (("sub/deeper/a.bin", 100), ("b.bin", 70_000)):
        status, at, body = out[name]
        assert status == 200 and len(body) == size, (name, status, body[:200])
        # Woken by the placement (a poll would be 50 ms; a full look 1 s): within a loaded CI's bound.
        assert at - placed[name] < 0.5, (name, at - placed[name])
    assert "never.bin" not in out  # still held: nothing placed for it

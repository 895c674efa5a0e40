"""A node's bucket reads of objects it passes on as they come (issue 30, dscache_contract.peers.GROW_MIN):
the native copier writes such a body into the object's grow file as it comes and renames that file
into place, so its agent can follow it meanwhile (tests/unit/test_node_agent_grow.py). A body cut
short, or one the pin refuses, leaves no grow file behind (a peer following it sees it gone),
and the object is read again into a fresh one. A large object's parts land in any order in a file
sized first: its grow file says in an extended attribute how much of it is there from its start. A real Copier against the real S3 server, through a
proxy that cuts answers short."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from dscache_contract.peers import GROWN_XATTR, grow_name
from dscache_stager import native
from dscache_stager.source import S3Source
from dscache_stager.store import PreconditionError
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration

SIZE = 700_000


@pytest.fixture
def shard(s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, bytes]:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    body = os.urandom(SIZE)
    s3_server.put_tree(bucket, {"shards/s0.tar": body})
    return hashlib.md5(body).hexdigest(), body


def copy(
    server: S3Server, bucket: str, dest: Path, etag: str, policy=lambda n, line: "pass"
) -> tuple[list, BaseException | None, Path]:
    module = pytest.importorskip("dscache_native")
    proxy = FaultProxy((server.host, server.port), policy).start()
    (dest / "tmp").mkdir(parents=True)
    grow = dest / "tmp" / grow_name("shards/s0.tar")
    try:
        fetcher = native.NativeFetcher(
            module, S3Source(bucket, "", endpoint_url=proxy.endpoint), 4, workers=1, tmp_dir=str(dest / "tmp")
        )
        try:
            item = ("shards/s0.tar", str(dest / "s0.tar"), etag, None, SIZE)
            placed, failure = asyncio.run(asyncio.wait_for(fetcher.fetch([item], [str(grow)]), 60))
        finally:
            fetcher.close()
    finally:
        proxy.stop()
    return placed, failure, grow


def test_a_grown_object_is_placed_and_its_grow_file_gone(s3_server: S3Server, bucket: str, shard, tmp_path: Path):
    etag, body = shard
    placed, failure, grow = copy(s3_server, bucket, tmp_path / "d", etag)
    assert failure is None and [(i, f.size, f.etag) for i, f in placed] == [(0, SIZE, etag)]
    assert (tmp_path / "d" / "s0.tar").read_bytes() == body
    assert not grow.exists() and os.listdir(tmp_path / "d" / "tmp") == []


def test_a_body_cut_short_is_read_again_into_a_fresh_grow_file(s3_server: S3Server, bucket: str, shard, tmp_path: Path):
    etag, body = shard
    cut = lambda n, line: "short" if line.startswith("GET") and n == 0 else "pass"  # noqa: E731
    placed, failure, grow = copy(s3_server, bucket, tmp_path / "d", etag, cut)
    assert failure is None and len(placed) == 1
    assert (tmp_path / "d" / "s0.tar").read_bytes() == body
    assert not grow.exists()
    # Every answer cut short: the object fails, and neither it nor its grow file is left.
    placed, failure, grow = copy(s3_server, bucket, tmp_path / "e", etag, lambda n, line: "short")
    assert placed == [] and failure is not None
    assert not grow.exists() and not (tmp_path / "e" / "s0.tar").exists()


def test_the_pin_refuses_other_bytes_and_leaves_no_grow_file(s3_server: S3Server, bucket: str, shard, tmp_path: Path):
    placed, failure, grow = copy(s3_server, bucket, tmp_path / "d", "0" * 32)
    assert placed == [] and isinstance(failure, PreconditionError)
    assert not grow.exists() and os.listdir(tmp_path / "d" / "tmp") == []


def test_a_large_objects_grow_file_says_how_much_of_it_is_there_from_its_start(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A large object's parts land in any order in a file sized first: its GROWN_XATTR says how far
    from the start it is whole (what the agent passes on), and is gone once the file is placed."""
    module = pytest.importorskip("dscache_native")
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    part = 256 << 10
    body = os.urandom(4 * part)
    s3_server.put_tree(bucket, {"ckpt/w.bin": body})
    # The second part's GET is held 3 s: the first, third and fourth land meanwhile.
    proxy = FaultProxy(
        (s3_server.host, s3_server.port),
        lambda n, line: "pass",
        hold_s=3.0,
        hold_match=rf"(?im)^range: bytes={part}-",
        hold_head=True,
    ).start()
    dest = tmp_path / "d"
    (dest / "tmp").mkdir(parents=True)
    grow = dest / "tmp" / grow_name("ckpt/w.bin")
    seen: list[tuple[int, int]] = []
    try:
        source = S3Source(bucket, "", endpoint_url=proxy.endpoint)
        fetcher = native.NativeFetcher(module, source, 8, workers=2, tmp_dir=str(dest / "tmp"), part_bytes=part)
        try:
            item = ("ckpt/w.bin", str(dest / "w.bin"), hashlib.md5(body).hexdigest(), None, len(body))
            job = threading.Thread(target=lambda: seen.append(fetcher.fetch_large_blocking(item, str(grow))))
            job.start()
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                try:
                    seen.append((os.stat(grow).st_size, int(os.getxattr(grow, GROWN_XATTR))))
                except OSError:
                    pass
                time.sleep(0.05)
            job.join(30)
        finally:
            fetcher.close()
    finally:
        proxy.stop()
    *looks, done = seen
    # Its attribute never past the first part while the second is held, the file sized meanwhile.
    assert looks and all(grown <= part for _, grown in looks), looks
    assert looks[-1] == (len(body), part), looks[-1]
    assert done.size == len(body)
    assert (dest / "w.bin").read_bytes() == body and not grow.exists()
    assert os.stat(dest / "w.bin").st_mode & 0o777 == 0o444  # read-only once placed, as every file
    with pytest.raises(OSError):
        os.getxattr(dest / "w.bin", GROWN_XATTR)

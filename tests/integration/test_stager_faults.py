"""Throttling, dropped connections, revoked credentials and full disks, on a real S3 server."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.faultproxy import FaultProxy, deny_after, random_faults
from tests.support.s3server import S3Server
from tests.support.stager import data_tree, expected_tree, run_stage

pytestmark = pytest.mark.integration


def upstream(server: S3Server) -> tuple[str, int]:
    return (server.host, server.port)


def test_throttling_and_connection_resets_are_retried(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {f"f/{i}.bin": os.urandom(100_000 + i) for i in range(120)}
    files["f/big.bin"] = os.urandom(20 << 20)
    s3_server.put_tree(bucket, files)
    proxy = FaultProxy(upstream(s3_server), random_faults(slowdown=0.2, reset=0.1, seed=3)).start()
    try:
        r = run_stage(s3_server, "sync", f"s3://{bucket}/f/", str(tmp_path / "c"), "--concurrency", "16",
                      endpoint=proxy.endpoint)
    finally:
        proxy.stop()
    assert r.code == 0, r.stderr
    assert proxy.counts.get("slowdown", 0) > 5 and proxy.counts.get("reset", 0) > 5, proxy.counts
    assert data_tree(tmp_path / "c") == expected_tree(files, "f/")


def test_credentials_revoked_mid_run_fail_cleanly(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {f"r/{i}.bin": os.urandom(30_000) for i in range(300)}
    s3_server.put_tree(bucket, files)
    proxy = FaultProxy(upstream(s3_server), deny_after(60)).start()
    dest = tmp_path / "c"
    try:
        r = run_stage(s3_server, "sync", f"s3://{bucket}/r/", str(dest), "--concurrency", "4",
                      "--termination-log", str(tmp_path / "t"), endpoint=proxy.endpoint)
    finally:
        proxy.stop()
    assert r.code == 3, r.stderr
    assert "access denied" in r.stderr.splitlines()[-1]
    assert (tmp_path / "t").read_text().startswith("error: access denied")
    # Nothing partial is visible: every file present is whole, no marker, no temp files.
    seen = data_tree(dest)
    want = expected_tree(files, "r/")
    assert 0 < len(seen) < len(want)
    assert all(want[p] == d for p, d in seen.items())
    assert not (dest / ".dscache/complete").exists()
    assert os.listdir(dest / ".dscache/tmp") == []


@pytest.fixture
def small_disk(tmp_path: Path):
    """A size- and inode-limited tmpfs, like a nearly full NVMe."""
    def mount(size: str, inodes: int = 10_000) -> Path:
        mnt = tmp_path / f"disk-{size}-{inodes}"
        mnt.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes}", "tmpfs", str(mnt)], check=True)
        mounts.append(mnt)
        return mnt
    mounts: list[Path] = []
    yield mount
    for m in mounts:
        subprocess.run(["umount", str(m)], check=False)


def test_not_enough_space_fails_fast_naming_both_numbers(s3_server: S3Server, bucket: str, small_disk, tmp_path: Path):
    s3_server.put_tree(bucket, {f"s/{i}.bin": os.urandom(1 << 20) for i in range(4)})
    disk = small_disk("2m")
    r = run_stage(s3_server, "sync", f"s3://{bucket}/s/", str(disk / "c"), "--termination-log", str(tmp_path / "t"))
    assert r.code == 4, r.stderr
    msg = (tmp_path / "t").read_text()
    assert msg.startswith("error: not enough space")
    assert "need at least 4194304 bytes" in msg and "free" in msg
    assert os.listdir(disk / "c" / ".dscache" / "tmp") == []


def test_disk_filling_up_mid_run_is_a_clear_error(s3_server: S3Server, bucket: str, small_disk, tmp_path: Path):
    # Bytes fit, inodes do not: the kernel says ENOSPC partway through.
    files = {f"i/{i}.bin": b"x" * 100 for i in range(200)}
    s3_server.put_tree(bucket, files)
    disk = small_disk("8m", inodes=60)
    r = run_stage(s3_server, "sync", f"s3://{bucket}/i/", str(disk / "c"), "--termination-log", str(tmp_path / "t"))
    assert r.code == 6, r.stderr
    assert (tmp_path / "t").read_text().startswith("error: disk full")
    seen = data_tree(disk / "c")
    assert all(files["i/" + p] == (disk / "c" / p).read_bytes() for p in seen)
    assert not (disk / "c" / ".dscache" / "complete").exists()

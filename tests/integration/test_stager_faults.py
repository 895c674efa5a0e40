"""Throttling, dropped connections, revoked credentials and full disks, on a real S3 server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import dscache_contract as contract
from tests.support.faultproxy import FaultProxy, deny_after, random_faults
from tests.support.s3server import S3Server
from tests.support.stager import boto3_revision, data_dir, data_tree, expected_tree, stage

pytestmark = pytest.mark.integration


def upstream(server: S3Server) -> tuple[str, int]:
    return (server.host, server.port)


def test_throttling_and_connection_resets_are_retried(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {f"f/{i}.bin": os.urandom(100_000 + i) for i in range(120)}
    files["f/big.bin"] = os.urandom(20 << 20)
    s3_server.put_tree(bucket, files)
    rev = boto3_revision(s3_server, f"s3://{bucket}/f/")
    proxy = FaultProxy(upstream(s3_server), random_faults(slowdown=0.2, reset=0.1, seed=3)).start()
    try:
        r = stage(s3_server, f"s3://{bucket}/f/", tmp_path / "c", rev, concurrency=16, endpoint=proxy.endpoint)
    finally:
        proxy.stop()
    assert r.code == 0, r.stderr
    assert proxy.counts.get("slowdown", 0) > 5 and proxy.counts.get("reset", 0) > 5, proxy.counts
    assert data_tree(data_dir(tmp_path / "c", rev)) == expected_tree(files, "f/")


def test_cli_exit_7_when_s3_keeps_failing(s3_server: S3Server, bucket: str, tmp_path: Path):
    """Listing works, every object GET is throttled: after every retry, exit 7 and a reason."""
    s3_server.put_tree(bucket, {f"t/{i}.bin": b"x" * 100 for i in range(3)})
    rev = boto3_revision(s3_server, f"s3://{bucket}/t/")

    def throttle_gets(n: int, line: str) -> str:
        return "slowdown" if line.startswith("GET ") and "list-type" not in line else "pass"

    proxy = FaultProxy(upstream(s3_server), throttle_gets).start()
    try:
        r = stage(
            s3_server,
            f"s3://{bucket}/t/",
            tmp_path / "c",
            rev,
            endpoint=proxy.endpoint,
            retry_timeout=1.0,
            termination_log=str(tmp_path / "t"),
            timeout=120,
        )
    finally:
        proxy.stop()
    assert r.code == 7, r.stderr
    assert proxy.counts["slowdown"] >= 3 * 5  # every object, every attempt
    assert (tmp_path / "t").read_text().startswith("error: S3 kept failing for")
    assert "re-run to resume" in r.stderr
    assert not os.path.exists(contract.complete_path(str(tmp_path / "c"), rev))


def test_credentials_revoked_mid_run_fail_cleanly(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {f"r/{i}.bin": os.urandom(30_000) for i in range(300)}
    s3_server.put_tree(bucket, files)
    rev = boto3_revision(s3_server, f"s3://{bucket}/r/")
    proxy = FaultProxy(upstream(s3_server), deny_after(60)).start()
    cache = tmp_path / "c"
    dest = data_dir(cache, rev)
    try:
        r = stage(
            s3_server,
            f"s3://{bucket}/r/",
            cache,
            rev,
            concurrency=4,
            termination_log=str(tmp_path / "t"),
            endpoint=proxy.endpoint,
        )
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
    assert not os.path.exists(contract.complete_path(str(cache), rev))
    assert os.listdir(contract.tmp_dir(str(cache), rev)) == []


def test_not_enough_space_fails_fast_naming_both_numbers(s3_server: S3Server, bucket: str, small_disk, tmp_path: Path):
    s3_server.put_tree(bucket, {f"s/{i}.bin": os.urandom(1 << 20) for i in range(4)})
    rev = boto3_revision(s3_server, f"s3://{bucket}/s/")
    disk = small_disk("2m")
    r = stage(s3_server, f"s3://{bucket}/s/", disk / "c", rev, termination_log=str(tmp_path / "t"))
    assert r.code == 4, r.stderr
    msg = (tmp_path / "t").read_text()
    assert msg.startswith("error: not enough space")
    assert "need at least 4194304 bytes" in msg and "free" in msg
    assert os.listdir(contract.tmp_dir(str(disk / "c"), rev)) == []


def test_disk_filling_up_mid_run_is_a_clear_error(s3_server: S3Server, bucket: str, small_disk, tmp_path: Path):
    # Bytes fit, inodes do not: the kernel says ENOSPC partway through.
    files = {f"i/{i}.bin": b"x" * 100 for i in range(200)}
    s3_server.put_tree(bucket, files)
    rev = boto3_revision(s3_server, f"s3://{bucket}/i/")
    disk = small_disk("8m", inodes=60)
    r = stage(s3_server, f"s3://{bucket}/i/", disk / "c", rev, termination_log=str(tmp_path / "t"))
    assert r.code == 6, r.stderr
    assert (tmp_path / "t").read_text().startswith("error: disk full")
    data = data_dir(disk / "c", rev)
    seen = data_tree(data)
    assert seen and all(files["i/" + p] == (data / p).read_bytes() for p in seen)
    assert not os.path.exists(contract.complete_path(str(disk / "c"), rev))

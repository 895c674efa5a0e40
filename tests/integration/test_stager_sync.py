"""dscache-stage sync against a real S3 server (versitygw)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.s3server import S3Server
from tests.support.stager import data_tree, expected_tree, run_stage, stage_cmd, stage_env

pytestmark = pytest.mark.integration


def sample(n: int = 60, seed: int = 1) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"data/part{i % 4}/f{i:03d}.bin": rng.randbytes(rng.randrange(1, 40_000)) for i in range(n)}
    files["data/top.txt"] = b"top level\n"
    files["data/sp ace/é+%.txt"] = b"odd but legal name"
    files["other/not-me.bin"] = b"outside the prefix"
    return files


def test_copies_prefix_exactly_with_manifest_and_summary(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = sample()
    s3_server.put_tree(bucket, files)
    term = tmp_path / "termination-log"
    dest = tmp_path / "cache"

    r = run_stage(s3_server, "sync", f"s3://{bucket}/data/", str(dest), "--termination-log", str(term))

    assert r.code == 0, r.stderr
    assert data_tree(dest) == expected_tree(files, "data/")
    summary = r.summary
    assert summary["objects"] == len(files) - 1 and summary["skipped"] == 0
    assert summary["bytes"] == sum(len(v) for k, v in files.items() if k.startswith("data/"))
    assert json.loads(term.read_text()) == summary
    manifest = [json.loads(l) for l in (dest / ".dscache/manifest.jsonl").read_text().splitlines()]
    assert {m["key"] for m in manifest} == {k for k in files if k.startswith("data/")}
    assert all(m["size"] == len(files[m["key"]]) and m["etag"] for m in manifest)
    assert (dest / ".dscache/complete").exists()
    assert os.listdir(dest / ".dscache/tmp") == []
    assert "objects" in r.stderr and "MB/s" in r.stderr  # progress lines


def test_prefix_without_trailing_slash_means_directory(s3_server: S3Server, bucket: str, tmp_path: Path):
    s3_server.put_tree(bucket, {"ds/a.bin": b"a", "ds2/b.bin": b"b"})
    r = run_stage(s3_server, "sync", f"s3://{bucket}/ds", str(tmp_path / "c"))
    assert r.code == 0, r.stderr
    assert set(data_tree(tmp_path / "c")) == {"a.bin"}


def test_include_and_exclude(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {"d/train/a.tfrecord": b"1", "d/train/b.tfrecord": b"2", "d/train/skip.tmp": b"3",
             "d/val/c.tfrecord": b"4", "d/README": b"5"}
    s3_server.put_tree(bucket, files)
    r = run_stage(s3_server, "sync", f"s3://{bucket}/d/", str(tmp_path / "c"),
                  "--include", "train/*", "--include", "*.md", "--exclude", "*.tmp")
    assert r.code == 0, r.stderr
    assert set(data_tree(tmp_path / "c")) == {"train/a.tfrecord", "train/b.tfrecord"}


def test_resync_skips_unchanged_refetches_changed_and_deletes_removed(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = sample(30)
    s3_server.put_tree(bucket, files)
    dest = tmp_path / "c"
    assert run_stage(s3_server, "sync", f"s3://{bucket}/data/", str(dest)).code == 0

    client = s3_server.client()
    client.delete_object(Bucket=bucket, Key="data/part0/f000.bin")
    client.delete_object(Bucket=bucket, Key="data/sp ace/é+%.txt")  # its directory goes too
    client.put_object(Bucket=bucket, Key="data/part1/f001.bin", Body=b"changed")
    client.put_object(Bucket=bucket, Key="data/new/n.bin", Body=b"new")
    (dest / "stray.txt").write_text("not from the bucket")
    files = {k: v for k, v in files.items() if k not in ("data/part0/f000.bin", "data/sp ace/é+%.txt")}
    files |= {"data/part1/f001.bin": b"changed", "data/new/n.bin": b"new"}

    r = run_stage(s3_server, "sync", f"s3://{bucket}/data/", str(dest))

    assert r.code == 0, r.stderr
    assert data_tree(dest) == expected_tree(files, "data/")
    assert not (dest / "sp ace").exists()
    s = r.summary
    assert s["fetched_bytes"] == len(b"changed") + len(b"new")
    assert s["skipped"] == s["objects"] - 2
    assert s["deleted"] == 3  # two objects gone from the bucket, one stray file


def test_resume_after_sigkill_gives_byte_exact_tree(s3_server: S3Server, bucket: str, tmp_path: Path):
    rng = random.Random(7)
    files = {f"k/{i % 10}/{i}.bin": rng.randbytes(rng.randrange(1000, 300_000)) for i in range(150)}
    files["k/big.bin"] = rng.randbytes(40 << 20)  # ranged GETs with pwrite
    s3_server.put_tree(bucket, files)
    dest = tmp_path / "c"
    cmd = stage_cmd("sync", f"s3://{bucket}/k/", str(dest), "--endpoint-url", s3_server.endpoint, "--concurrency", "8")
    want = expected_tree(files, "k/")
    for _ in range(6):
        p = subprocess.Popen(cmd, env=stage_env(s3_server), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.2, 1.2))
        p.send_signal(signal.SIGKILL)
        p.wait()
        # Whatever is visible under a final name is whole and correct.
        seen = data_tree(dest) if dest.exists() else {}
        assert all(want[path] == digest for path, digest in seen.items())
        assert not (dest / ".dscache/complete").exists() or seen == want

    r = run_stage(s3_server, "sync", f"s3://{bucket}/k/", str(dest))
    assert r.code == 0, r.stderr
    assert data_tree(dest) == want
    assert os.listdir(dest / ".dscache/tmp") == []


def test_concurrent_stagers_copy_once(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {f"c/{i}.bin": os.urandom(50_000) for i in range(200)}
    s3_server.put_tree(bucket, files)
    dest = tmp_path / "c"
    (dest / ".dscache").mkdir(parents=True)
    cmd = stage_cmd("sync", f"s3://{bucket}/c/", str(dest), "--endpoint-url", s3_server.endpoint)
    # Hold the lock so that all three pods of the "Job" start while it is taken.
    with open(dest / ".dscache/lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [subprocess.Popen(cmd, env=stage_env(s3_server), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(3)]
        deadline = time.monotonic() + 30
        while _lock_waiters(dest / ".dscache/lock") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1] for o in outs]
    summaries = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    total = sum(len(v) for v in files.values())
    assert sorted(s["fetched_bytes"] for s in summaries) == [0, 0, total]
    assert sum("reusing the copy another stager just completed" in o[1] for o in outs) == 2
    assert data_tree(dest) == expected_tree(files, "c/")


def _lock_waiters(path: Path) -> int:
    """Processes blocked in flock() on path, from /proc/locks ('->' lines)."""
    inode = os.stat(path).st_ino
    return sum(1 for line in open("/proc/locks") if "->" in line and line.split()[-3].endswith(f":{inode}"))


def test_directory_markers_are_skipped_and_empty_files_kept(s3_server: S3Server, bucket: str, tmp_path: Path):
    s3_server.put_tree(bucket, {"m/": b"", "m/dir/": b"", "m/dir/f.bin": b"data", "m/empty.txt": b""})
    r = run_stage(s3_server, "sync", f"s3://{bucket}/m/", str(tmp_path / "c"))
    assert r.code == 0, r.stderr
    assert data_tree(tmp_path / "c") == expected_tree({"m/dir/f.bin": b"data", "m/empty.txt": b""}, "m/")
    again = run_stage(s3_server, "sync", f"s3://{bucket}/m/", str(tmp_path / "c"))
    assert again.code == 0 and again.summary["skipped"] == 2 and again.summary["fetched_bytes"] == 0


def test_no_such_bucket(s3_server: S3Server, tmp_path: Path):
    r = run_stage(s3_server, "sync", "s3://does-not-exist/x/", str(tmp_path / "c"), "--termination-log", str(tmp_path / "t"))
    assert r.code == 3, r.stderr
    assert "no such bucket: does-not-exist" in r.stderr
    assert (tmp_path / "t").read_text().startswith("error: no such bucket")


def test_access_denied_with_wrong_secret(s3_server: S3Server, bucket: str, tmp_path: Path):
    s3_server.put_tree(bucket, {"a/b": b"x"})
    env = stage_env(s3_server, AWS_SECRET_ACCESS_KEY="wrong")
    r = run_stage(s3_server, "sync", f"s3://{bucket}/a/", str(tmp_path / "c"), env=env)
    assert r.code == 3, r.stderr
    assert "access denied" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("dscache-stage: error:")


def test_unreachable_endpoint_fails_fast(s3_server: S3Server, tmp_path: Path):
    from tests.support.s3server import free_port
    t = time.monotonic()
    r = run_stage(s3_server, "sync", "s3://b/x/", str(tmp_path / "c"), endpoint=f"http://127.0.0.1:{free_port()}")
    assert r.code == 3 and "cannot reach the S3 endpoint" in r.stderr
    assert time.monotonic() - t < 30


def test_bad_usage(s3_server: S3Server, tmp_path: Path):
    r = run_stage(s3_server, "sync", "bucket/x", str(tmp_path / "c"))
    assert r.code == 2 and "s3://BUCKET/PREFIX" in r.stderr


@pytest.mark.parametrize("zero_copy", [True, False], ids=["splice", "obstore-stream"])
def test_large_object_paths_write_exact_bytes(s3_server: S3Server, bucket: str, tmp_path: Path, zero_copy: bool,
                                              monkeypatch: pytest.MonkeyPatch):
    """Both large-object paths: splice (plain-HTTP endpoints) and obstore streaming (HTTPS)."""
    import asyncio

    from dscache_stager.fetch import PART_SIZE, Fetcher
    from dscache_stager.source import S3Source
    from dscache_stager.tree import LocalTree

    body = os.urandom(2 * PART_SIZE + 12345)
    s3_server.put_tree(bucket, {"big/blob": body})
    etag = s3_server.client().head_object(Bucket=bucket, Key="big/blob")["ETag"].strip('"')
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    store = S3Source.parse(f"s3://{bucket}/big/", endpoint_url=s3_server.endpoint).open_store(8)
    (tmp_path / "tmp").mkdir()
    fetcher = Fetcher(store, LocalTree(str(tmp_path)), str(tmp_path / "tmp"), asyncio.Semaphore(8), lambda n: None,
                      zero_copy=zero_copy)
    try:
        got = asyncio.run(fetcher.fetch("big/blob", "out/blob", len(body), etag))
    finally:
        fetcher.close()
    assert (got.size, got.etag) == (len(body), etag)
    assert (tmp_path / "out" / "blob").read_bytes() == body
    assert os.listdir(tmp_path / "tmp") == []


def test_unchanged_resync_never_withdraws_the_completion_marker(s3_server: S3Server, bucket: str, tmp_path: Path):
    s3_server.put_tree(bucket, {"u/a": b"a", "u/b/c": b"c"})
    dest = tmp_path / "c"
    assert run_stage(s3_server, "sync", f"s3://{bucket}/u/", str(dest)).code == 0
    before = (dest / ".dscache/complete").stat().st_ino
    r = run_stage(s3_server, "sync", f"s3://{bucket}/u/", str(dest))
    assert r.code == 0 and r.summary["skipped"] == 2
    assert (dest / ".dscache/complete").stat().st_ino == before  # not even rewritten
    r = run_stage(s3_server, "sync", f"s3://{bucket}/u/", str(dest), "--exclude", "b/*")
    assert r.code == 0 and set(data_tree(dest)) == {"a"}
    assert (dest / ".dscache/complete").stat().st_ino != before

"""The one-page copy (onepage.py: no asyncio) against a real S3 server (versitygw): it stages
what sync.py stages, fails as it fails, and resumes from its journal. DSCACHE_ONEPAGE=0 forces
sync.py's path for the same revision; each run's closing note says which path copied."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.stager import (
    StageResult,
    boto3_revision,
    data_dir,
    data_tree,
    expected_tree,
    run_stage,
    stage,
    stage_cmd,
    stage_env,
    sync_argv,
)

pytestmark = pytest.mark.integration

ONEPAGE = "on the main thread"  # onepage.OnePage's closing note
SYNC = "on the event-loop thread"  # sync._Run's


def small_revision(seed: int = 3) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"o/part{i % 3}/f{i:03d}.bin": rng.randbytes(rng.randrange(1, 300_000)) for i in range(40)}
    files["o/sp ace/é+%.txt"] = b"odd but legal name"
    files["o/empty.txt"] = b""  # a real empty file: HEAD, then placed
    files["o/part0/"] = b""  # a marker of a directory filled anyway
    files["o/lone/"] = b""  # a marker of an empty directory: nothing placed
    files["other.bin"] = b"outside the prefix"
    return files


def _manifest(cache: Path, rev: str) -> str:
    return Path(contract.manifest_path(str(cache), rev)).read_text()


def _path_taken(r: StageResult) -> str:
    assert (ONEPAGE in r.stderr) != (SYNC in r.stderr), r.stderr
    return "onepage" if ONEPAGE in r.stderr else "sync"


def _imported(r: StageResult, module: str) -> bool:
    """Whether a run with PYTHONPROFILEIMPORTTIME imported ``module`` ("import time: ... | name")."""
    return any(
        ln.startswith("import time:") and ln.rsplit("|", 1)[-1].strip() == module for ln in r.stderr.splitlines()
    )


def _one_page_path(data_plane: str) -> str:
    """The path a one-page small revision takes: onepage.py needs the native plane."""
    return "onepage" if data_plane == "native" else "sync"


def test_one_page_copy_stages_what_sync_stages(s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str):
    files = small_revision()
    s3_server.put_tree(bucket, files)
    uri = f"s3://{bucket}/o/"
    rev = boto3_revision(s3_server, uri)

    # PYTHONPROFILEIMPORTTIME: every module the run imported, on stderr.
    one = stage(s3_server, uri, tmp_path / "one", rev, env=stage_env(s3_server, PYTHONPROFILEIMPORTTIME="1"))
    ref = stage(
        s3_server,
        uri,
        tmp_path / "ref",
        rev,
        env=stage_env(s3_server, DSCACHE_ONEPAGE="0", PYTHONPROFILEIMPORTTIME="1"),
    )

    assert one.code == 0, one.stderr
    assert ref.code == 0, ref.stderr
    assert (_path_taken(one), _path_taken(ref)) == (_one_page_path(data_plane), "sync")
    assert (_imported(one, "asyncio"), _imported(ref, "asyncio")) == (data_plane != "native", True)
    want = expected_tree({k: v for k, v in files.items() if k != "o/lone/"}, "o/")
    assert data_tree(data_dir(tmp_path / "one", rev)) == data_tree(data_dir(tmp_path / "ref", rev)) == want
    assert not (data_dir(tmp_path / "one", rev) / "lone").exists()
    assert _manifest(tmp_path / "one", rev) == _manifest(tmp_path / "ref", rev)
    a, b = dict(one.summary), dict(ref.summary)
    for timed in ("seconds", "mb_s"):  # the runs' own timing
        assert a.pop(timed) >= 0 and b.pop(timed) >= 0
    assert a == b and a["objects"] == 42 and a["revision"] == rev, (a, b)
    for cache in (tmp_path / "one", tmp_path / "ref"):
        assert sorted(os.listdir(contract.revision_dir(str(cache), rev))) == ["data", "meta"]  # no tmp left


def test_large_objects_are_copied_in_parts_on_this_thread_as_sync_copies_them(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    # Two large objects (ranged parts; SMALL_LIMIT is 1 MiB) beside small ones and an empty one:
    # the large ones on the native pool's threads while the small ones go on the main thread.
    rng = random.Random(5)
    files = {
        "l/small.bin": b"s",
        "l/d/large.bin": rng.randbytes((1 << 20) + 1),
        "l/d/e/larger.bin": rng.randbytes(3 << 20),
        "l/empty.txt": b"",
        **{f"l/s/f{i}.bin": rng.randbytes(rng.randrange(1, 100_000)) for i in range(20)},
    }
    s3_server.put_tree(bucket, files)
    uri = f"s3://{bucket}/l/"
    rev = boto3_revision(s3_server, uri)
    one = stage(s3_server, uri, tmp_path / "one", rev)
    ref = stage(s3_server, uri, tmp_path / "ref", rev, env=stage_env(s3_server, DSCACHE_ONEPAGE="0"))
    assert one.code == 0, one.stderr
    assert ref.code == 0, ref.stderr
    assert (_path_taken(one), _path_taken(ref)) == (_one_page_path(data_plane), "sync")
    if data_plane == "native":
        assert "2 large object(s) in " in one.stderr, one.stderr  # NativeFetcher's ranged parts
    want = expected_tree(files, "l/")
    assert data_tree(data_dir(tmp_path / "one", rev)) == data_tree(data_dir(tmp_path / "ref", rev)) == want
    assert _manifest(tmp_path / "one", rev) == _manifest(tmp_path / "ref", rev)
    a, b = dict(one.summary), dict(ref.summary)
    for timed in ("seconds", "mb_s"):
        assert a.pop(timed) >= 0 and b.pop(timed) >= 0
    assert a == b and a["objects"] == len(files) and a["fetched_bytes"] == sum(map(len, files.values())), (a, b)
    for cache in (tmp_path / "one", tmp_path / "ref"):
        assert sorted(os.listdir(contract.revision_dir(str(cache), rev))) == ["data", "meta"]  # no tmp left


def test_an_object_changed_after_pinning_fails_with_exit_9_and_stages_nothing(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    s3_server.put_tree(bucket, {f"g/{i}.bin": bytes([i]) * 100 for i in range(10)})
    uri, cache = f"s3://{bucket}/g/", tmp_path / "c"
    pinned = boto3_revision(s3_server, uri)
    s3_server.client().put_object(Bucket=bucket, Key="g/3.bin", Body=b"new bytes")
    now = boto3_revision(s3_server, uri)

    r = stage(s3_server, uri, cache, pinned, termination_log=str(tmp_path / "t"))

    assert r.code == 9, r.stderr
    assert _path_taken(r) == _one_page_path(data_plane)
    msg = (tmp_path / "t").read_text()
    assert msg.startswith(f"error: revision {pinned} of {uri}") and f"revision {now} now" in msg
    assert not os.path.exists(contract.revision_dir(str(cache), pinned))


def test_an_object_replaced_mid_copy_fails_with_exit_9(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    s3_server.put_tree(bucket, {f"m/{i:02d}.bin": bytes([i]) * 1000 for i in range(20)})
    uri, cache = f"s3://{bucket}/m/", tmp_path / "c"
    pinned = boto3_revision(s3_server, uri)
    client, replaced = s3_server.client(), []

    def policy(n: int, line: str) -> str:
        # The first object GET: replace that very object upstream, then let the GET through.
        if not replaced and line.startswith("GET ") and "list-type" not in line:
            key = line.split()[1].split("?")[0].split("/", 2)[2]
            client.put_object(Bucket=bucket, Key=key, Body=b"replaced while staging")
            replaced.append(key)
        return "pass"

    proxy = FaultProxy((s3_server.host, s3_server.port), policy).start()
    try:
        r = stage(s3_server, uri, cache, pinned, endpoint=proxy.endpoint, concurrency=2)
    finally:
        proxy.stop()
    assert replaced
    assert r.code == 9, r.stderr
    assert _path_taken(r) == _one_page_path(data_plane)
    assert "changed or was deleted after revision" in r.stderr
    assert not os.path.exists(contract.revision_dir(str(cache), pinned))


def test_a_large_object_replaced_mid_copy_fails_with_exit_9_and_leaves_no_part(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    rng = random.Random(7)
    files = {"x/big.bin": rng.randbytes(3 << 20), **{f"x/s{i}.bin": rng.randbytes(1000) for i in range(5)}}
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/x/", tmp_path / "c"
    pinned = boto3_revision(s3_server, uri)
    client, replaced = s3_server.client(), []

    def policy(n: int, line: str) -> str:
        # The large object's first GET (one of its ranged parts): replace it upstream, then let the GET through.
        if not replaced and line.startswith("GET ") and "/x/big.bin" in line:
            client.put_object(Bucket=bucket, Key="x/big.bin", Body=b"replaced while staging")
            replaced.append(line)
        return "pass"

    proxy = FaultProxy((s3_server.host, s3_server.port), policy).start()
    try:
        r = stage(s3_server, uri, cache, pinned, endpoint=proxy.endpoint)
    finally:
        proxy.stop()
    assert replaced
    assert r.code == 9, r.stderr
    assert _path_taken(r) == _one_page_path(data_plane)
    assert "changed or was deleted after revision" in r.stderr
    assert not os.path.exists(contract.revision_dir(str(cache), pinned))  # no part, no temp file


def test_resume_after_sigkill_skips_what_the_journal_holds(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    rng = random.Random(11)
    files = {f"k/{i % 5}/{i:03d}.bin": rng.randbytes(rng.randrange(1000, 50_000)) for i in range(120)}
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/k/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    journal = Path(contract.journal_path(str(cache), rev))
    complete = Path(contract.complete_path(str(cache), rev))
    want = expected_tree(files, "k/")
    # One request at a time, 10 ms each way: the kill lands mid-copy, after a chunk was journalled.
    proxy = FaultProxy((s3_server.host, s3_server.port), lambda n, line: "pass", rtt_ms=20).start()
    cmd = stage_cmd(
        *sync_argv(uri, cache, rev, concurrency=1, progress_interval=0.05), "--endpoint-url", proxy.endpoint
    )
    try:
        p = subprocess.Popen(cmd, env=stage_env(s3_server), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p.poll() is None and not (journal.exists() and journal.stat().st_size):
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        _, err = p.communicate()
    finally:
        proxy.stop()
    assert p.returncode == -signal.SIGKILL and not complete.exists(), err
    assert ("one listing page" in err.decode()) == (data_plane == "native"), err
    seen = data_tree(data_dir(cache, rev))
    assert 0 < len(seen) < len(want) and all(want[path] == digest for path, digest in seen.items())

    final = run_stage(s3_server, *sync_argv(uri, cache, rev))
    assert final.code == 0, final.stderr
    assert _path_taken(final) == _one_page_path(data_plane)
    assert data_tree(data_dir(cache, rev)) == want
    s = final.summary
    assert s["skipped"] > 0 and s["skipped"] + s["fetched_objects"] == len(want), s  # it resumed
    assert [json.loads(ln)["key"] for ln in _manifest(cache, rev).splitlines()] == sorted(files)

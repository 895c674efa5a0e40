"""dscache-stage sync against a real S3 server (versitygw): the copy itself."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.stager import (
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


def sample(n: int = 60, seed: int = 1) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"data/part{i % 4}/f{i:03d}.bin": rng.randbytes(rng.randrange(1, 40_000)) for i in range(n)}
    files["data/top.txt"] = b"top level\n"
    files["data/sp ace/é+%.txt"] = b"odd but legal name"
    files["other/not-me.bin"] = b"outside the prefix"
    return files


def recording_proxy(server: S3Server) -> tuple[FaultProxy, list[str]]:
    lines: list[str] = []

    def policy(n: int, line: str) -> str:
        lines.append(line)
        return "pass"

    return FaultProxy((server.host, server.port), policy).start(), lines


def test_copies_prefix_exactly_with_manifest_summary_lease_and_sealed_tree(
    s3_server: S3Server, bucket: str, tmp_path: Path
):
    files = sample()
    s3_server.put_tree(bucket, files)
    uri = f"s3://{bucket}/data/"
    rev = boto3_revision(s3_server, uri)
    term = tmp_path / "termination-log"
    cache = tmp_path / "cache"

    r = stage(s3_server, uri, cache, rev, pod_uid="pod-a", termination_log=str(term))

    assert r.code == 0, r.stderr
    data = data_dir(cache, rev)
    assert data_tree(data) == expected_tree(files, "data/")
    summary = r.summary
    assert summary["objects"] == len(files) - 1 and summary["skipped"] == 0 and summary["warm"] is False
    assert summary["bytes"] == sum(len(v) for k, v in files.items() if k.startswith("data/"))
    assert summary["revision"] == rev
    assert json.loads(term.read_text()) == summary
    c = str(cache)
    manifest = [json.loads(ln) for ln in Path(contract.manifest_path(c, rev)).read_text().splitlines()]
    assert {m["key"] for m in manifest} == {k for k in files if k.startswith("data/")}
    assert all(m["size"] == len(files[m["key"]]) and m["etag"] for m in manifest)
    assert json.loads(Path(contract.complete_path(c, rev)).read_text())["revision"] == rev
    assert sorted(os.listdir(contract.revision_dir(c, rev))) == ["data", "meta"]  # no tmp left
    assert sorted(os.listdir(contract.meta_dir(c, rev))) == ["complete", "manifest.jsonl"]
    assert os.listdir(contract.lease_dir(c, rev)) == ["pod-a"]
    # Sealed: files 0444, directories 0555, so only root could change them.
    for root, _dirs, fs in os.walk(data):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o555, root
        for f in fs:
            assert stat.S_IMODE(os.lstat(os.path.join(root, f)).st_mode) == 0o444
    assert "objects" in r.stderr and "MB/s" in r.stderr  # progress lines


def test_stager_and_operator_compute_the_same_revision(s3_server: S3Server, bucket: str, tmp_path: Path):
    """The `revision` subcommand lists with obstore, the operator with boto3: same contract, same id."""
    files = sample(40) | {
        "data/m/": b"",
        "data/m/in": b"x",
        "data/empty": b"",
        "data/lone/": b"",
        "data/a-b": b"sorts before a/ in S3",
        "data/a/x": b"ax",
    }
    s3_server.put_tree(bucket, files)
    for include, exclude in [((), ()), (("part1/*", "*.txt"), ("*f001*",)), ((), ("m/*",))]:
        args = [f"--include={g}" for g in include] + [f"--exclude={g}" for g in exclude]
        r = run_stage(s3_server, "revision", f"s3://{bucket}/data", *args)
        assert r.code == 0, r.stderr
        assert json.loads(r.stdout)["revision"] == boto3_revision(s3_server, f"s3://{bucket}/data", include, exclude)


def test_prefix_without_trailing_slash_means_directory(s3_server: S3Server, bucket: str, tmp_path: Path):
    s3_server.put_tree(bucket, {"ds/a.bin": b"a", "ds2/b.bin": b"b"})
    rev = boto3_revision(s3_server, f"s3://{bucket}/ds")
    r = stage(s3_server, f"s3://{bucket}/ds", tmp_path / "c", rev)
    assert r.code == 0, r.stderr
    assert set(data_tree(data_dir(tmp_path / "c", rev))) == {"a.bin"}


def test_include_and_exclude(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {
        "d/train/a.tfrecord": b"1",
        "d/train/b.tfrecord": b"2",
        "d/train/skip.tmp": b"3",
        "d/val/c.tfrecord": b"4",
        "d/README": b"5",
    }
    s3_server.put_tree(bucket, files)
    inc, exc = ("train/*", "*.md"), ("*.tmp",)
    rev = boto3_revision(s3_server, f"s3://{bucket}/d/", inc, exc)
    r = stage(s3_server, f"s3://{bucket}/d/", tmp_path / "c", rev, include=inc, exclude=exc)
    assert r.code == 0, r.stderr
    assert set(data_tree(data_dir(tmp_path / "c", rev))) == {"train/a.tfrecord", "train/b.tfrecord"}


def test_warm_start_lists_nothing_and_proves_access_with_one_request(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {f"w/{i}.bin": os.urandom(2000) for i in range(300)}
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/w/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    assert stage(s3_server, uri, cache, rev, pod_uid="first").code == 0
    proxy, lines = recording_proxy(s3_server)
    try:
        r = stage(s3_server, uri, cache, rev, pod_uid="second", endpoint=proxy.endpoint)
    finally:
        proxy.stop()
    assert r.code == 0, r.stderr
    s = r.summary
    assert (s["warm"], s["fetched_bytes"], s["objects"], s["revision"]) == (True, 0, 300, rev)
    first_key = json.loads(Path(contract.manifest_path(str(cache), rev)).read_text().splitlines()[0])["key"]
    assert lines == [f"HEAD /{bucket}/{first_key} HTTP/1.1"], lines  # no listing, one request
    assert sorted(os.listdir(contract.lease_dir(str(cache), rev))) == ["first", "second"]


def test_cold_copy_goes_on_from_the_access_proofs_listing_page(s3_server: S3Server, bucket: str, tmp_path: Path):
    """The access proof's listing page is the copy's first page: over three pages (2,100 keys),
    three ListObjectsV2 requests in all, the later ones carried on by S3's continuation token."""
    files = {f"p/{i:05d}.bin": i.to_bytes(4, "little") for i in range(2100)}
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/p/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    proxy, lines = recording_proxy(s3_server)
    try:
        r = stage(s3_server, uri, cache, rev, endpoint=proxy.endpoint)
    finally:
        proxy.stop()
    assert r.code == 0, r.stderr
    assert r.summary["objects"] == 2100 and r.summary["revision"] == rev
    assert data_tree(data_dir(cache, rev)) == expected_tree(files, "p/")
    lists = [ln for ln in lines if "list-type=2" in ln]
    assert len(lists) == 3, lists
    assert sum("continuation-token" in ln for ln in lists) == 2, lists


def test_resume_after_sigkill_gives_byte_exact_tree(s3_server: S3Server, bucket: str, tmp_path: Path):
    rng = random.Random(7)
    files = {f"k/{i % 10}/{i}.bin": rng.randbytes(rng.randrange(1000, 300_000)) for i in range(300)}
    files["k/big.bin"] = rng.randbytes(40 << 20)  # ranged GETs
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/k/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    r = Path(contract.revision_dir(str(cache), rev))
    journal, complete = Path(contract.journal_path(str(cache), rev)), Path(contract.complete_path(str(cache), rev))
    want = expected_tree(files, "k/")
    # A slow link (one request at a time, 10 ms each way) so that every kill lands
    # mid-copy, however fast the data plane (the native one copies these in a second).
    proxy = FaultProxy((s3_server.host, s3_server.port), lambda n, line: "pass", rtt_ms=20).start()
    cmd = stage_cmd(*sync_argv(uri, cache, rev, concurrency=1, progress_interval=0.1), "--endpoint-url", proxy.endpoint)
    try:
        kills = 0
        for _ in range(3):
            p = subprocess.Popen(cmd, env=stage_env(s3_server), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            before = journal.stat().st_size if journal.exists() else 0
            deadline = time.monotonic() + 60
            while (
                time.monotonic() < deadline
                and p.poll() is None
                and (not journal.exists() or journal.stat().st_size <= before)
            ):
                time.sleep(0.02)
            p.send_signal(signal.SIGKILL)
            p.wait()
            if p.returncode == -signal.SIGKILL and not complete.exists():
                kills += 1
            # Whatever is visible under a final name is whole and correct.
            seen = data_tree(r / "data") if (r / "data").exists() else {}
            assert all(want[path] == digest for path, digest in seen.items())
            assert not complete.exists() or seen == want
    finally:
        proxy.stop()
    assert kills == 3, "every kill must land before the copy completed"
    assert 0 < len(data_tree(r / "data")) < len(want)

    final = run_stage(s3_server, *sync_argv(uri, cache, rev))
    assert final.code == 0, final.stderr
    assert data_tree(r / "data") == want
    s = final.summary
    assert s["skipped"] > 0 and s["fetched_objects"] < len(want), s  # it resumed
    assert s["skipped"] + s["fetched_objects"] == len(want)
    assert not (r / "tmp").exists()


def _lock_waiters(path: Path) -> int:
    """Processes blocked in flock() on path, from /proc/locks ('->' lines)."""
    inode = os.stat(path).st_ino
    return sum(1 for line in open("/proc/locks") if "->" in line and line.split()[-3].endswith(f":{inode}"))


def test_concurrent_stagers_copy_once(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {f"c/{i}.bin": os.urandom(50_000) for i in range(200)}
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/c/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    cache.mkdir()
    # Hold the lock so that all three pods of the "Job" start while it is taken.
    with open(cache / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen(
                stage_cmd(*sync_argv(uri, cache, rev, pod_uid=f"pod-{i}"), "--endpoint-url", s3_server.endpoint),
                env=stage_env(s3_server),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(3)
        ]
        deadline = time.monotonic() + 30
        while _lock_waiters(cache / "lock") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _lock_waiters(cache / "lock") == 3
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1] for o in outs]
    summaries = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    total = sum(len(v) for v in files.values())
    assert sorted(s["fetched_bytes"] for s in summaries) == [0, 0, total]
    assert sorted(s["warm"] for s in summaries) == [False, True, True]
    assert data_tree(data_dir(cache, rev)) == expected_tree(files, "c/")
    assert sorted(os.listdir(contract.lease_dir(str(cache), rev))) == ["pod-0", "pod-1", "pod-2"]


def test_directory_markers_and_empty_files_without_a_request_each(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = {"m/": b"", "m/dir/": b"", "m/dir/f.bin": b"data", "m/lone/": b""}
    files |= {f"m/e/{i:04d}/": b"" for i in range(100)}  # markers of directories we fill anyway
    files |= {f"m/e/{i:04d}/x.bin": b"x" for i in range(100)}
    files |= {f"m/z/{i:04d}.txt": b"" for i in range(200)}  # real empty files
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/m/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    proxy, lines = recording_proxy(s3_server)
    try:
        r = stage(s3_server, uri, cache, rev, endpoint=proxy.endpoint, concurrency=4)
    finally:
        proxy.stop()
    assert r.code == 0, r.stderr
    want = expected_tree({k: v for k, v in files.items() if k != "m/lone/"}, "m/")
    assert data_tree(data_dir(cache, rev)) == want
    assert not (data_dir(cache, rev) / "lone").exists()  # a marker, never a file
    heads = [ln for ln in lines if ln.startswith("HEAD ")]
    # Only empty objects with nothing under them are ambiguous (a file "a" or a marker "a/"):
    # 200 empty files and m/lone/. Markers of filled directories cost nothing; empty files no GET.
    assert len(heads) == 201, len(heads)
    gets = [ln for ln in lines if ln.startswith("GET ") and "list-type" not in ln]
    assert len(gets) == 101  # the non-empty objects only


def test_no_such_bucket(s3_server: S3Server, tmp_path: Path):
    r = stage(s3_server, "s3://does-not-exist/x/", tmp_path / "c", "r-" + "0" * 20, termination_log=str(tmp_path / "t"))
    assert r.code == 3, r.stderr
    assert "no such bucket: does-not-exist" in r.stderr
    assert (tmp_path / "t").read_text().startswith("error: no such bucket")


def test_unreachable_endpoint_fails_fast(s3_server: S3Server, tmp_path: Path):
    from tests.support.s3server import free_port

    t = time.monotonic()
    r = stage(s3_server, "s3://b/x/", tmp_path / "c", "r-" + "0" * 20, endpoint=f"http://127.0.0.1:{free_port()}")
    assert r.code == 3 and "cannot reach the S3 endpoint" in r.stderr
    assert time.monotonic() - t < 30


def test_bad_usage(s3_server: S3Server, tmp_path: Path):
    r = run_stage(s3_server, "sync", "bucket/x", str(tmp_path / "c"), "--revision", "r-" + "0" * 20)
    assert r.code == 2 and "s3://BUCKET/PREFIX" in r.stderr
    r = run_stage(s3_server, "sync", "s3://b/x", str(tmp_path / "c"), "--revision", "latest")
    assert r.code == 2 and "not a dscache revision id" in r.stderr
    r = run_stage(
        s3_server,
        "sync",
        "s3://b/x",
        str(tmp_path / "c"),
        "--revision",
        "r-" + "0" * 20,
        "--pod-uid",
        contract.POD_UID_ARG,
    )
    assert r.code == 2 and "was not expanded" in r.stderr


@pytest.mark.parametrize("zero_copy", [True, False], ids=["splice", "obstore-stream"])
def test_large_object_paths_write_exact_bytes(
    s3_server: S3Server, bucket: str, tmp_path: Path, zero_copy: bool, monkeypatch: pytest.MonkeyPatch
):
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
    fetcher = Fetcher(
        lambda: store,
        LocalTree(str(tmp_path)),
        str(tmp_path / "tmp"),
        asyncio.Semaphore(8),
        lambda n: None,
        zero_copy=zero_copy,
    )
    try:
        got = asyncio.run(fetcher.fetch("big/blob", "out/blob", len(body), etag))
    finally:
        fetcher.close()
    assert (got.size, got.etag) == (len(body), etag)
    assert (tmp_path / "out" / "blob").read_bytes() == body
    assert os.listdir(tmp_path / "tmp") == []
    # The path under test really ran: three parts, all by splice(2) or all streamed.
    assert (fetcher.spliced_parts, fetcher.streamed_parts) == ((3, 0) if zero_copy else (0, 3))


def test_the_stager_splices_large_objects_from_a_plain_http_endpoint(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    """The test above drives Fetcher directly; this one runs the real CLI against the
    plain-HTTP test endpoint, so a python plane that stops choosing splice(2) fails here.
    The native plane copies large objects itself (test_stager_large.py): Fetcher copies none."""
    from dscache_stager.fetch import PART_SIZE

    body = os.urandom(2 * PART_SIZE + 12345)
    s3_server.put_tree(bucket, {"sp/blob": body})
    assert s3_server.endpoint.startswith("http://")
    uri, cache = f"s3://{bucket}/sp/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    # The real CLI, with the Fetcher it builds wrapped only to report which path each part took.
    spy = (
        "import json, sys, dscache_stager.sync as s\n"
        "class Spy(s.Fetcher):\n"
        "    def close(self):\n"
        "        print('parts ' + json.dumps([self.spliced_parts, self.streamed_parts]), file=sys.stderr)\n"
        "        super().close()\n"
        "s.Fetcher = Spy\n"
        "from dscache_stager.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = [*sync_argv(uri, cache, rev), "--endpoint-url", s3_server.endpoint]
    p = subprocess.run([sys.executable, "-c", spy, *argv], env=stage_env(s3_server), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (data_dir(cache, rev) / "blob").read_bytes() == body
    parts = [json.loads(line[len("parts ") :]) for line in p.stderr.splitlines() if line.startswith("parts ")]
    if data_plane == "native":
        # A one-page revision: onepage.py's native copier takes it in ranged parts; no Fetcher is built.
        assert parts == [] and "1 large object(s) in 3 ranged parts" in p.stderr, p.stderr
    else:
        assert parts == [[3, 0]], f"(spliced, streamed) parts: {parts}"


def test_cli_exit_1_on_an_internal_error_leaves_a_reason(s3_server: S3Server, bucket: str, tmp_path: Path):
    """Any unexpected exception: exit 1, a traceback on stderr, and one line in the termination log."""
    s3_server.put_tree(bucket, {"i/a": b"a"})
    boom = (
        "import sys, dscache_stager.stage as s\n"
        "def sync(*a, **k): raise RuntimeError('simulated bug')\n"
        "s.sync = sync\n"
        "from dscache_stager.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = sync_argv(f"s3://{bucket}/i/", tmp_path / "c", "r-" + "0" * 20, termination_log=str(tmp_path / "t"))
    p = subprocess.run([sys.executable, "-c", boom, *argv], env=stage_env(s3_server), capture_output=True, text=True)
    assert p.returncode == 1, p.stderr
    assert "Traceback" in p.stderr and "RuntimeError: simulated bug" in p.stderr
    assert (tmp_path / "t").read_text() == "error: internal error: RuntimeError: simulated bug\n"


def test_manifest_is_streamed_in_path_order_with_empty_files_merged(s3_server: S3Server, bucket: str, tmp_path: Path):
    # The manifest is written while listing (never held in memory) and empty files, settled
    # after the listing, are merged in: the result is one line per file, in path order.
    files = {
        "s/a.bin": b"a",
        "s/a/0": b"",
        "s/a/1.bin": b"one",
        "s/a0.txt": b"",
        "s/b": b"bee",
        "s/c/d/e.bin": b"deep",
        "s/c/e": b"",
        "s/marker/": b"",
    }
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/s/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    r = stage(s3_server, uri, cache, rev)
    assert r.code == 0, r.stderr
    lines = Path(contract.manifest_path(str(cache), rev)).read_text().splitlines()
    paths = [json.loads(line)["path"] for line in lines]
    want = expected_tree({k: v for k, v in files.items() if not k.endswith("/")}, "s/")
    assert paths == sorted(want)
    assert data_tree(data_dir(cache, rev)) == want
    assert json.loads(r.stdout.strip().splitlines()[-1])["objects"] == len(want)
    assert not os.path.exists(contract.tmp_dir(str(cache), rev))


def test_the_chosen_data_plane_copies_the_small_objects(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    """The native plane really runs when chosen (and the python plane when it is off):
    the stager names it in its log, and either copies the same bytes."""
    files = sample(n=200, seed=7)
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/data/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    r = stage(s3_server, uri, cache, rev)
    assert r.code == 0, r.stderr
    assert ("native data plane:" in r.stderr) == (data_plane == "native"), r.stderr
    assert data_tree(data_dir(cache, rev)) == expected_tree(files, "data/")
    assert r.summary["fetched_objects"] == len(files) - 1


def test_credentials_from_the_boto3_chain_sign_every_request(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    """No keys in the environment: the stager takes them from boto3's chain (here a shared
    credentials file; IRSA and instance roles take the same path). The native plane asks
    Python for them from its own threads (dscache_native's credential_provider)."""
    files = sample(n=40, seed=11)
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/data/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[default]\naws_access_key_id = {s3_server.env['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {s3_server.env['AWS_SECRET_ACCESS_KEY']}\n"
    )
    env = {k: v for k, v in stage_env(s3_server).items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env["AWS_SHARED_CREDENTIALS_FILE"] = str(creds)
    env["AWS_CONFIG_FILE"] = str(tmp_path / "no-config")
    r = stage(s3_server, uri, cache, rev, env=env)
    assert r.code == 0, r.stderr
    assert data_tree(data_dir(cache, rev)) == expected_tree(files, "data/")
    # And a wrong secret from the same chain is refused as access denied (exit 3), on either plane.
    creds.write_text(creds.read_text().replace(s3_server.env["AWS_SECRET_ACCESS_KEY"], "not-the-secret"))
    r = stage(s3_server, uri, tmp_path / "c2", rev, env=env)
    assert r.code == 3 and "access denied" in r.stderr, r.stderr

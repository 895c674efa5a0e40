"""Issue 7 on the stager side, against a real S3 server (versitygw):
access proof on every run, pinned revisions, immutable side-by-side copies,
leases and wipes, and a mount source that disappeared."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_contract import WipeArgs
from dscache_stager import wipe as wipe_mod
from dscache_stager.wipe import wipe
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.stager import (
    boto3_revision,
    data_dir,
    data_tree,
    expected_tree,
    stage,
    stage_cmd,
    stage_env,
    sync_argv,
)

pytestmark = pytest.mark.integration


def dataset(n: int = 40) -> dict[str, bytes]:
    return {f"ds/{i % 5}/f{i:03d}.bin": os.urandom(1000 + 97 * i) for i in range(n)}


def snapshot(d: Path) -> dict[str, tuple]:
    """Every file's bytes digest, inode, mtime and mode: what a reader could notice changing."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = Path(root, f)
            st = p.lstat()
            out[str(p.relative_to(d))] = (
                hashlib.sha256(p.read_bytes()).hexdigest(),
                st.st_ino,
                st.st_mtime_ns,
                st.st_mode,
            )
    return out


def test_a_stager_without_access_exits_3_even_while_another_holds_a_complete_copy(
    s3_server: S3Server, bucket: str, tmp_path: Path
):
    files = dataset()
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/ds/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    assert stage(s3_server, uri, cache, rev, pod_uid="allowed").code == 0
    denied = stage_env(s3_server, AWS_SECRET_ACCESS_KEY="not-the-secret")
    # Another stager holds the lock (and the copy is complete): the denied pod
    # is refused before it ever waits for the lock or looks at the copy.
    with open(cache / "lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t = time.monotonic()
        r = stage(
            s3_server, uri, cache, rev, pod_uid="denied", env=denied, termination_log=str(tmp_path / "t"), timeout=60
        )
        assert time.monotonic() - t < 30
    assert r.code == 3, r.stderr
    assert "access denied" in r.stderr and "not served without access" in r.stderr
    assert r.stdout == ""  # no summary: nothing was handed to the pod
    assert (tmp_path / "t").read_text().startswith("error: access denied")
    assert os.listdir(contract.lease_dir(str(cache), rev)) == ["allowed"]  # no lease for the denied pod
    # And with the lock free too.
    r = stage(s3_server, uri, cache, rev, pod_uid="denied", env=denied)
    assert r.code == 3 and "access denied" in r.stderr


@pytest.mark.parametrize("change", ["overwrite", "delete", "add"])
def test_bucket_changed_after_pinning_fails_with_exit_9_and_serves_nothing(
    s3_server: S3Server, bucket: str, tmp_path: Path, change: str
):
    files = dataset()
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/ds/", tmp_path / "c"
    pinned = boto3_revision(s3_server, uri)
    client = s3_server.client()
    if change == "overwrite":
        client.put_object(Bucket=bucket, Key="ds/1/f001.bin", Body=b"new bytes")
    elif change == "delete":
        client.delete_object(Bucket=bucket, Key="ds/2/f002.bin")
    else:
        client.put_object(Bucket=bucket, Key="ds/new.bin", Body=b"added later")
    now = boto3_revision(s3_server, uri)
    assert now != pinned

    r = stage(s3_server, uri, cache, pinned, termination_log=str(tmp_path / "t"))

    assert r.code == 9, r.stderr
    msg = (tmp_path / "t").read_text()
    assert msg.startswith(f"error: revision {pinned} of {uri}") and f"revision {now} now" in msg
    assert "re-run the Job" in msg
    assert r.stdout == ""
    assert not os.path.exists(contract.revision_dir(str(cache), pinned))  # the incomplete copy is gone
    # The current revision stages fine.
    ok = stage(s3_server, uri, cache, now)
    assert ok.code == 0, ok.stderr


def test_an_object_replaced_mid_copy_fails_with_exit_9_never_a_mix(s3_server: S3Server, bucket: str, tmp_path: Path):
    files = dataset(60)
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/ds/", tmp_path / "c"
    pinned = boto3_revision(s3_server, uri)
    client = s3_server.client()
    replaced = []

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
    assert "changed or was deleted after revision" in r.stderr
    assert not os.path.exists(contract.revision_dir(str(cache), pinned))


def test_a_complete_revision_is_never_modified_by_a_later_sync_of_another(
    s3_server: S3Server, bucket: str, tmp_path: Path
):
    files = dataset()
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/ds/", tmp_path / "c"
    r1 = boto3_revision(s3_server, uri)
    assert stage(s3_server, uri, cache, r1, pod_uid="job-a").code == 0
    before = snapshot(data_dir(cache, r1))
    manifest_before = Path(contract.manifest_path(str(cache), r1)).read_bytes()

    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="ds/1/f001.bin", Body=b"version two")
    client.delete_object(Bucket=bucket, Key="ds/2/f002.bin")
    files2 = {k: v for k, v in files.items() if k != "ds/2/f002.bin"} | {"ds/1/f001.bin": b"version two"}
    r2 = boto3_revision(s3_server, uri)
    res = stage(s3_server, uri, cache, r2, pod_uid="job-b")
    assert res.code == 0, res.stderr
    assert res.summary["revision"] == r2 and res.summary["warm"] is False

    # Side by side: A's copy is untouched to the inode, B's has the new bytes.
    assert snapshot(data_dir(cache, r1)) == before
    assert Path(contract.manifest_path(str(cache), r1)).read_bytes() == manifest_before
    assert data_tree(data_dir(cache, r1)) == expected_tree(files, "ds/")
    assert data_tree(data_dir(cache, r2)) == expected_tree(files2, "ds/")
    assert sorted(os.listdir(cache / "revs")) == sorted([r1, r2])
    # Staging r1 again (a late pod of job A) is warm and still changes nothing.
    again = stage(s3_server, uri, cache, r1, pod_uid="job-a-2")
    assert again.code == 0 and again.summary["warm"] is True
    assert snapshot(data_dir(cache, r1)) == before


def test_a_stager_waiting_behind_a_real_wipe_stages_the_revision_again(
    s3_server: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    files = dataset()
    s3_server.put_tree(bucket, files)
    uri = f"s3://{bucket}/ds/"
    root = tmp_path / "root"
    cache = root / "ns" / "ds"
    rev = boto3_revision(s3_server, uri)
    assert stage(s3_server, uri, cache, rev, pod_uid="job-1").code == 0

    deleting, go_on = threading.Event(), threading.Event()
    real_remove = wipe_mod.remove_tree

    def slow_remove(path: str) -> None:  # the real wipe, paused while it holds the lock
        deleting.set()
        go_on.wait(30)
        real_remove(path)

    monkeypatch.setattr(wipe_mod, "remove_tree", slow_remove)
    result: dict = {}
    w = threading.Thread(
        target=lambda: result.setdefault(
            "wipe", wipe(WipeArgs(str(cache), str(root), revision=rev, release=("job-1",)))
        )
    )
    w.start()
    assert deleting.wait(10)
    p = subprocess.Popen(
        stage_cmd(*sync_argv(uri, cache, rev, pod_uid="job-2"), "--endpoint-url", s3_server.endpoint),
        env=stage_env(s3_server),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)
    assert p.poll() is None  # waiting on the lock the wipe holds
    go_on.set()
    w.join(30)
    out, err = p.communicate(timeout=120)
    assert result["wipe"].removed
    assert p.returncode == 0, err
    assert "waiting for it" in err
    s = json.loads(out.strip().splitlines()[-1])
    assert s["warm"] is False and s["fetched_bytes"] == sum(len(v) for v in files.values())  # started over
    assert data_tree(data_dir(cache, rev)) == expected_tree(files, "ds/")
    assert os.listdir(contract.lease_dir(str(cache), rev)) == ["job-2"]


def test_a_cache_dir_removed_under_the_mount_is_a_clear_error(s3_server: S3Server, bucket: str, tmp_path: Path):
    """The pod's view: C is bind-mounted; the node's C is deleted (DatasetCache gone)."""
    s3_server.put_tree(bucket, dataset(5))
    uri = f"s3://{bucket}/ds/"
    rev = boto3_revision(s3_server, uri)
    host_c, mount = tmp_path / "host" / "ns" / "ds", tmp_path / "pod-mount"
    host_c.mkdir(parents=True)
    mount.mkdir()
    subprocess.run(["mount", "--bind", str(host_c), str(mount)], check=True)
    try:
        assert stage(s3_server, uri, mount, rev).code == 0
        # wipe --all as the operator runs it when the DatasetCache is deleted
        assert wipe(WipeArgs(str(host_c), str(tmp_path / "host"), all_revisions=True, release=("pod-1",))).removed
        r = stage(s3_server, uri, mount, rev, termination_log=str(tmp_path / "t"))
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
    assert r.code == 10, r.stderr
    msg = (tmp_path / "t").read_text()
    assert msg.startswith(f"error: the cache dir {mount} was removed from the node") and "Delete this pod" in msg
    assert not host_c.exists()  # and nothing was recreated behind the operator's back


def test_an_upgraded_node_loses_its_version_1_copy_and_nothing_else(s3_server: S3Server, bucket: str, tmp_path: Path):
    """Version 1 staged straight into C (data at the top, metadata in C/.dscache). After the
    upgrade, revisions are staged beside it; ``wipe --legacy`` (the helper's command line)
    removes exactly the version 1 entries: the revision, its lease and the lock stay, to the inode."""
    files = dataset()
    s3_server.put_tree(bucket, files)
    uri = f"s3://{bucket}/ds/"
    root = tmp_path / "root"
    cache = root / "ns" / "ds"
    # The version 1 copy, as its stager left it (same objects, at the top of C).
    for key, body in files.items():
        p = cache / key[len("ds/") :]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body)
    v1_meta = cache / ".dscache"
    (v1_meta / "tmp").mkdir(parents=True)
    for name in ("lock", "manifest.jsonl", "complete"):
        (v1_meta / name).write_text("")
    v1_top = sorted(os.listdir(cache))
    rev = boto3_revision(s3_server, uri)
    first = stage(s3_server, uri, cache, rev, pod_uid="job-new")
    assert first.code == 0, first.stderr
    assert first.summary["warm"] is False
    before = snapshot(data_dir(cache, rev))
    meta_before = Path(contract.manifest_path(str(cache), rev)).read_bytes()

    def legacy_wipe() -> subprocess.CompletedProcess:
        return subprocess.run(
            stage_cmd(*WipeArgs(str(cache), str(root), legacy=True).to_argv()), capture_output=True, text=True
        )

    # A version 1 stager ran moments ago (its pod may be reading): nothing goes yet.
    busy = legacy_wipe()
    assert busy.returncode == int(contract.ExitCode.BUSY), busy.stderr
    assert "version 1 stager ran" in busy.stderr and sorted(os.listdir(cache)) == sorted(
        [*v1_top, "lock", "revs", "leases"]
    )
    quiet = time.time() - wipe_mod.LEGACY_QUIET_S - 60
    for p in v1_meta.iterdir():
        os.utime(p, (quiet, quiet))

    done = legacy_wipe()
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["legacy"], summary["removed"], summary["legacy_entries"]) == (True, True, len(v1_top))
    assert sorted(os.listdir(cache)) == ["leases", "lock", "revs"]
    assert snapshot(data_dir(cache, rev)) == before
    assert Path(contract.manifest_path(str(cache), rev)).read_bytes() == meta_before
    assert os.listdir(contract.lease_dir(str(cache), rev)) == ["job-new"]
    # The current revision is still complete: a late pod of the Job starts warm.
    again = stage(s3_server, uri, cache, rev, pod_uid="job-new-2")
    assert again.code == 0 and again.summary["warm"] is True
    assert data_tree(data_dir(cache, rev)) == expected_tree(files, "ds/")

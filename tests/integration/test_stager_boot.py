"""Copies recorded before the node's last boot are distrusted (no mocks: real mtimes, real S3).

The stager writes without fsync, so after a power loss a file may hold zeros
or stale bytes while the manifest still lists it with the right size. It
therefore distrusts a revision completed (and a journal written) before the
boot time (/proc/stat btime) and stages it again. The test ages the
revision's bookkeeping to before this machine's boot with os.utime, damages
one file keeping its size, and shows that the next sync repairs it; the
control run (bookkeeping from after the boot) is a warm reuse that leaves the
same damage in place. The same holds for an unfinished run's journal: one
written before the boot is not resumed from.
"""

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

FILES = {f"ds/part-{i:02d}.bin": bytes([i]) * (1000 + i) for i in range(12)}


def _boot_time() -> float:
    with open("/proc/stat") as f:
        return next(float(line.split()[1]) for line in f if line.startswith("btime "))


def _damage(victim: Path) -> Path:
    size, mode = victim.stat().st_size, victim.stat().st_mode
    os.chmod(victim, 0o644)  # a complete revision is sealed 0444, and so is every placed file
    victim.write_bytes(b"\0" * size)  # same size, wrong bytes: what a lost page cache leaves
    os.chmod(victim, mode)
    return victim


def _age_bookkeeping(meta: Path, when: float) -> None:
    aged = 0
    for name in ("manifest.jsonl", "journal.jsonl", "complete"):
        p = meta / name
        if p.exists():
            os.utime(p, (when, when))
            aged += 1
    assert (meta / "complete").exists() and aged >= 2, f"no sealed revision's bookkeeping in {meta}"


@pytest.mark.parametrize("before_boot", [True, False], ids=["recorded-before-boot", "control-after-boot"])
def test_copy_from_before_the_last_boot_is_refetched(s3_server, bucket, tmp_path: Path, before_boot: bool):
    s3_server.put_tree(bucket, FILES)
    uri = f"s3://{bucket}/ds/"
    rev = boto3_revision(s3_server, uri)
    cache = tmp_path / "cache"
    first = stage(s3_server, uri, cache, rev)
    assert first.code == 0, first.stderr
    data = data_dir(cache, rev)
    want = expected_tree(FILES, "ds/")
    assert data_tree(data) == want
    total = sum(len(v) for v in FILES.values())
    assert first.summary["fetched_bytes"] == total

    _damage(data / "part-03.bin")
    boot = _boot_time()
    meta = data.parent / "meta"
    _age_bookkeeping(meta, boot - 120 if before_boot else max(boot + 1, (meta / "complete").stat().st_mtime))
    second = stage(s3_server, uri, cache, rev, pod_uid="pod-2")
    assert second.code == 0, second.stderr
    if before_boot:
        # Nothing recorded before the boot is trusted: every object is fetched again.
        assert second.summary["fetched_bytes"] == total and second.summary["skipped"] == 0, second.summary
        assert second.summary["warm"] is False, second.summary
        assert data_tree(data) == want
    else:
        # The control: a revision sealed after the boot is trusted (warm: not even
        # listed), so the damage (same size) stays. This is what the aged run must not do.
        assert second.summary["fetched_bytes"] == 0 and second.summary["warm"] is True, second.summary
        assert data_tree(data) != want


def _killed_mid_copy(s3_server, uri: str, cache: Path, rev: str, journal: Path, complete: Path) -> list[str]:
    """One stager run SIGKILLed once its journal holds records; returns the paths it journalled."""
    # A slow link (one request at a time, 10 ms each way) so that the kill lands mid-copy however
    # fast the data plane is (CI saw the native one finish first on the open loopback).
    proxy = FaultProxy((s3_server.host, s3_server.port), lambda n, line: "pass", rtt_ms=20).start()
    try:
        cmd = stage_cmd(
            *sync_argv(uri, cache, rev, concurrency=1, progress_interval=0.1), "--endpoint-url", proxy.endpoint
        )
        p = subprocess.Popen(cmd, env=stage_env(s3_server), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while (
            time.monotonic() < deadline and p.poll() is None and (not journal.exists() or journal.stat().st_size == 0)
        ):
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        proxy.stop()
    assert p.returncode == -signal.SIGKILL and not complete.exists(), "the kill must land before the copy completed"
    paths = []
    for line in journal.read_text().splitlines():
        try:
            paths.append(json.loads(line)["path"])
        except (ValueError, KeyError):
            continue  # a torn last line
    assert paths, "the killed run journalled nothing"
    return paths


@pytest.mark.parametrize("before_boot", [True, False], ids=["journal-before-boot", "control-after-boot"])
def test_journal_from_before_the_last_boot_is_not_resumed(s3_server, bucket, tmp_path: Path, before_boot: bool):
    """An unfinished run's journal written before the boot is ignored: the files it lists
    are fetched again. The control (journal after the boot) resumes from it, so the
    damage done to a journalled file (same size) stays: what the aged run must not do."""
    rng = random.Random(11)
    files = {f"j/{i:03d}.bin": rng.randbytes(rng.randrange(50_000, 200_000)) for i in range(200)}
    files["j/zz-big.bin"] = rng.randbytes(40 << 20)  # listed last: the run is still copying when killed
    s3_server.put_tree(bucket, files)
    uri, cache = f"s3://{bucket}/j/", tmp_path / "cache"
    rev = boto3_revision(s3_server, uri)
    journal, complete = Path(contract.journal_path(str(cache), rev)), Path(contract.complete_path(str(cache), rev))
    journalled = _killed_mid_copy(s3_server, uri, cache, rev, journal, complete)
    data = data_dir(cache, rev)
    victim = _damage(data / journalled[0])
    boot = _boot_time()
    when = boot - 120 if before_boot else max(boot + 1, journal.stat().st_mtime)
    os.utime(journal, (when, when))

    final = stage(s3_server, uri, cache, rev, pod_uid="pod-2")
    assert final.code == 0, final.stderr
    want = expected_tree(files, "j/")
    s = final.summary
    if before_boot:
        assert s["skipped"] == 0 and s["fetched_objects"] == len(want), s  # nothing resumed
        assert data_tree(data) == want
    else:
        assert s["skipped"] >= len(journalled) > 0, s  # resumed from the journal
        assert data_tree(data)[str(victim.relative_to(data))] != want[str(victim.relative_to(data))]

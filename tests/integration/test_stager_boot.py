"""Copies recorded before the node's last boot are distrusted (no mocks: real mtimes, real S3).

The stager writes without fsync, so after a power loss a file may hold zeros
or stale bytes while the manifest still lists it with the right size. It
therefore distrusts a revision completed (and a journal written) before the
boot time (/proc/stat btime) and stages it again. The test ages the
revision's bookkeeping to before this machine's boot with os.utime, damages
one file keeping its size, and shows that the next sync repairs it; the
control run (bookkeeping from after the boot) is a warm reuse that leaves the
same damage in place.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.stager import boto3_revision, data_dir, data_tree, expected_tree, stage

pytestmark = pytest.mark.integration

FILES = {f"ds/part-{i:02d}.bin": bytes([i]) * (1000 + i) for i in range(12)}


def _boot_time() -> float:
    with open("/proc/stat") as f:
        return next(float(line.split()[1]) for line in f if line.startswith("btime "))


def _damage(data: Path) -> Path:
    victim = data / "part-03.bin"
    size = victim.stat().st_size
    mode = victim.stat().st_mode
    os.chmod(victim, 0o644)  # a complete revision is sealed 0444
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

    _damage(data)
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

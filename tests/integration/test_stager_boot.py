"""Copies recorded before the node's last boot are distrusted (no mocks: real mtimes, real S3).

The stager writes without fsync, so after a power loss a file may hold zeros
or stale bytes while the manifest still lists it with the right size. It
therefore ignores manifest and journal records older than the boot time
(/proc/stat btime) and fetches those objects again. The test ages the
bookkeeping to before this machine's boot with os.utime, damages one file
keeping its size, and shows that the next sync repairs it; the control run
(bookkeeping from after the boot) shows the same damage is otherwise skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.stager import data_tree, expected_tree, run_stage

pytestmark = pytest.mark.integration

FILES = {f"ds/part-{i:02d}.bin": bytes([i]) * (1000 + i) for i in range(12)}


def _boot_time() -> float:
    with open("/proc/stat") as f:
        return next(float(line.split()[1]) for line in f if line.startswith("btime "))


def _damage(dest: Path) -> Path:
    victim = dest / "part-03.bin"
    size = victim.stat().st_size
    victim.write_bytes(b"\0" * size)   # same size, wrong bytes: what a lost page cache leaves
    return victim


def _age_bookkeeping(dest: Path, when: float) -> None:
    for name in ("manifest.jsonl", "journal.jsonl", "complete"):
        p = dest / ".dscache" / name
        if p.exists():
            os.utime(p, (when, when))


@pytest.mark.parametrize("before_boot", [True, False], ids=["recorded-before-boot", "control-after-boot"])
def test_copy_from_before_the_last_boot_is_refetched(s3_server, bucket, tmp_path: Path, before_boot: bool):
    s3_server.put_tree(bucket, FILES)
    dest = tmp_path / "copy"
    first = run_stage(s3_server, "sync", f"s3://{bucket}/ds/", str(dest))
    assert first.code == 0, first.stderr
    want = expected_tree(FILES, "ds/")
    assert data_tree(dest) == want
    total = sum(len(v) for v in FILES.values())
    assert first.summary["fetched_bytes"] == total

    _damage(dest)
    boot = _boot_time()
    _age_bookkeeping(dest, boot - 120 if before_boot else max(boot + 1, dest.stat().st_mtime))
    second = run_stage(s3_server, "sync", f"s3://{bucket}/ds/", str(dest))
    assert second.code == 0, second.stderr
    if before_boot:
        # Nothing recorded before the boot is trusted: every object is fetched again.
        assert second.summary["fetched_bytes"] == total and second.summary["skipped"] == 0, second.summary
        assert data_tree(dest) == want
    else:
        # The control: records from after the boot are trusted, so the damage (same
        # size) is skipped. This is what the aged run must not do.
        assert second.summary["fetched_bytes"] == 0, second.summary
        assert data_tree(dest) != want

"""Where the stager places a revision on ext4 (against a real S3 server): revs/ carries
FS_TOPDIR_FL, so ext4 spreads revisions over block groups instead of putting a new one where
a wiped one was just freed; the interim name leaves nothing behind; a wipe and a restage copy
the same bytes. On both data planes (tests/integration/conftest.py)."""

from __future__ import annotations

import fcntl
import os
import random
import sys
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_stager.layout import FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_TOPDIR_FL, discard
from tests.support.s3server import S3Server
from tests.support.stager import boto3_revision, data_dir, data_tree, expected_tree, stage

pytestmark = pytest.mark.integration


def flags(path: Path) -> int | None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = bytearray(8)
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf, True)
        return int.from_bytes(buf[:4], sys.byteorder)
    except OSError:
        return None
    finally:
        os.close(fd)


def ext4_like(path: Path) -> bool:
    """Whether ``path``'s filesystem keeps FS_TOPDIR_FL (ext2/3/4)."""
    probe = path / "probe"
    probe.mkdir()
    try:
        before = flags(probe)
        if before is None:
            return False
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECTORY)
        try:
            buf = bytearray((before | FS_TOPDIR_FL).to_bytes(4, sys.byteorder) + bytes(4))
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, buf, False)
        except OSError:
            return False
        finally:
            os.close(fd)
        return bool((flags(probe) or 0) & FS_TOPDIR_FL)
    finally:
        probe.rmdir()


def test_a_wiped_revision_is_restaged_into_a_spread_revs(s3_server: S3Server, bucket: str, tmp_path: Path) -> None:
    if not ext4_like(tmp_path):
        pytest.skip(f"{tmp_path} is not on ext2/3/4: the flag is ignored there (tests/unit covers it)")
    rng = random.Random(7)
    files = {f"ds/d{i % 7}/f{i:03d}.bin": rng.randbytes(rng.randrange(1, 20_000)) for i in range(200)}
    s3_server.put_tree(bucket, files)
    uri = f"s3://{bucket}/ds/"
    rev = boto3_revision(s3_server, uri)
    cache = tmp_path / "cache"

    for pod in ("pod-a", "pod-b"):
        r = stage(s3_server, uri, cache, rev, pod_uid=pod)
        assert r.code == 0, r.stderr
        assert r.summary["warm"] is False and r.summary["objects"] == len(files)
        assert data_tree(data_dir(cache, rev)) == expected_tree(files, "ds/")
        revs = Path(contract.revisions_root(str(cache)))
        assert (flags(revs) or 0) & FS_TOPDIR_FL
        assert not (flags(Path(contract.revision_dir(str(cache), rev))) or 0) & FS_TOPDIR_FL
        assert os.listdir(revs) == [rev]  # the interim name is gone
        discard(contract.revision_dir(str(cache), rev))  # the node's wipe, then a fresh stage at once
        assert os.listdir(revs) == []

"""DSCACHE_TRACE=1 on a real copy of two listing pages (versitygw): the timeline accounts for every
object, in the order the copy runs (issue 30, smallwan36: how the page-boundary stalls were found)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.s3server import S3Server
from tests.support.stager import boto3_revision, data_dir, stage, stage_env

pytestmark = pytest.mark.integration

#: Two ListObjectsV2 pages (S3 sends at most 1,000 keys a page): the copy goes through sync.py.
KEYS = [f"t/{i // 100:02}/{i:05}" for i in range(1100)]


def test_a_traced_copy_of_two_pages_marks_its_start_pages_batches_and_end(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    client = s3_server.client()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=k.encode()), KEYS))
    uri = f"s3://{bucket}/t/"
    rev = boto3_revision(s3_server, uri)
    cache = tmp_path / "c"
    r = stage(s3_server, uri, cache, rev, env=stage_env(s3_server, DSCACHE_TRACE="1"))
    assert r.code == 0, r.stderr
    events = [line.split()[1:] for line in r.stderr.splitlines() if line.startswith("dscache-trace ")]
    times = [float(t) for t, _, _ in events]
    assert times == sorted(times)
    names = [e for _, e, _ in events]
    count = {e: sum(int(n) for _, name, n in events if name == e) for e in set(names)}
    assert names[0] == "start" and names[1] == "first-page" and names[-1] == "done"
    assert count["first-page"] == 1000
    assert count["page"] == len(KEYS)  # the first page again, as the copy takes it, and the second
    assert count["done"] == len(KEYS)
    if "batch-go" in count:  # the native plane: every object handed down and placed
        assert count["batch-go"] == count["batch-done"] == len(KEYS)
    assert sorted(p.name for p in data_dir(cache, rev).rglob("*") if p.is_file()) == sorted(
        k.rsplit("/", 1)[1] for k in KEYS
    )

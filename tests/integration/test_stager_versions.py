"""Revisions in a versioned bucket, against a real S3 server (versitygw with a
versioning dir): a pod admitted with a revision keeps getting exactly its
bytes after objects are overwritten, deleted or added, and fails clearly once
the bucket no longer holds a pinned version."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import dscache_contract as contract
from tests.support.s3server import S3Server
from tests.support.stager import boto3_pin, data_dir, data_tree, expected_tree, run_stage, stage

pytestmark = pytest.mark.integration

BIG = "ds/big/part-0.bin"  # over the stager's 1 MiB single-GET limit: fetched in ranged parts


def dataset() -> dict[str, bytes]:
    files = {f"ds/{i % 3}/f{i:02d}.bin": os.urandom(500 + 37 * i) for i in range(12)}
    files[BIG] = os.urandom((1 << 20) + 4321)
    files["ds/empty.txt"] = b""
    return files


def test_a_pinned_revision_keeps_its_bytes_after_overwrite_delete_and_add(
    versioned_s3: S3Server, versioned_bucket: str, tmp_path: Path
):
    files = dataset()
    versioned_s3.put_tree(versioned_bucket, files)
    client = versioned_s3.client()
    # A directory marker: in the digest, never a file (an empty dir is skipped, as unversioned).
    client.put_object(Bucket=versioned_bucket, Key="ds/emptydir/", Body=b"")
    uri, cache = f"s3://{versioned_bucket}/ds/", tmp_path / "c"
    first = boto3_pin(versioned_s3, uri)
    assert first.versioned and first.objects == len(files) + 1

    # The bucket moves on: an overwrite (of the big one too), a delete, an addition.
    with versioned_s3.keeping_version_times(versioned_bucket):
        client.put_object(Bucket=versioned_bucket, Key=BIG, Body=b"replaced")
        client.put_object(Bucket=versioned_bucket, Key="ds/0/f00.bin", Body=b"replaced too")
        client.delete_object(Bucket=versioned_bucket, Key="ds/1/f01.bin")
        client.put_object(Bucket=versioned_bucket, Key="ds/new.bin", Body=b"added later")
    second = boto3_pin(versioned_s3, uri)
    assert second.revision != first.revision and second.as_of >= first.as_of

    r = stage(versioned_s3, uri, cache, first.revision, as_of=first.as_of)
    assert r.code == 0, r.stderr
    assert data_tree(data_dir(cache, first.revision)) == expected_tree(files, "ds/")
    assert r.summary["revision"] == first.revision
    manifest = Path(contract.manifest_path(str(cache), first.revision)).read_text().splitlines()
    big = next(contract.ManifestEntry.from_json(line) for line in manifest if BIG in line)
    assert big.version_id is not None and big.size == len(files[BIG])  # the pinned version, named

    now = {**files, BIG: b"replaced", "ds/0/f00.bin": b"replaced too", "ds/new.bin": b"added later"}
    del now["ds/1/f01.bin"]
    r = stage(versioned_s3, uri, cache, second.revision, as_of=second.as_of, pod_uid="pod-2")
    assert r.code == 0, r.stderr
    assert data_tree(data_dir(cache, second.revision)) == expected_tree(now, "ds/")
    # Side by side: the first revision was not touched by the second.
    assert data_tree(data_dir(cache, first.revision)) == expected_tree(files, "ds/")

    # `dscache-stage revision` pins exactly as the operator does, time included.
    printed = run_stage(versioned_s3, "revision", uri)
    assert printed.code == 0, printed.stderr
    assert json.loads(printed.stdout.strip().splitlines()[-1]) == {
        "revision": second.revision,
        "objects": second.objects,
        "bytes": second.bytes,
        "as_of": second.as_of,
    }


def test_a_pinned_version_deleted_for_good_fails_with_exit_9_and_serves_nothing(
    versioned_s3: S3Server, versioned_bucket: str, tmp_path: Path
):
    files = dataset()
    versioned_s3.put_tree(versioned_bucket, files)
    uri, cache = f"s3://{versioned_bucket}/ds/", tmp_path / "c"
    pinned = boto3_pin(versioned_s3, uri)
    client = versioned_s3.client()
    version = client.head_object(Bucket=versioned_bucket, Key="ds/2/f02.bin")["VersionId"]
    with versioned_s3.keeping_version_times(versioned_bucket):
        client.delete_object(Bucket=versioned_bucket, Key="ds/2/f02.bin", VersionId=version)  # gone, history and all

    r = stage(versioned_s3, uri, cache, pinned.revision, as_of=pinned.as_of, termination_log=str(tmp_path / "t"))

    assert r.code == 9, r.stderr
    msg = (tmp_path / "t").read_text()
    assert msg.startswith(f"error: revision {pinned.revision} of {uri}") and "no longer in the bucket" in msg
    assert r.stdout == ""
    assert not os.path.exists(contract.revision_dir(str(cache), pinned.revision))


def test_without_the_as_of_time_a_versioned_revision_is_not_found(
    versioned_s3: S3Server, versioned_bucket: str, tmp_path: Path
):
    """The digest covers versionIds: an argv that lost --as-of lists without them
    and cannot match, so it fails instead of staging some other bytes."""
    versioned_s3.put_tree(versioned_bucket, dataset())
    uri = f"s3://{versioned_bucket}/ds/"
    pinned = boto3_pin(versioned_s3, uri)
    r = stage(versioned_s3, uri, tmp_path / "c", pinned.revision)
    assert r.code == 9, r.stderr

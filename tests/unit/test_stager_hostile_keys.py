"""Hostile keys. versitygw stores objects as files and cannot hold them, so
these run against moto's S3 server, which accepts any key, as real S3 does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

import dscache_contract as contract
from tests.support.s3server import free_port


@pytest.fixture(scope="module")
def moto_endpoint():
    port = free_port()
    server = ThreadedMotoServer(port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def put(endpoint: str, bucket: str, keys: dict[str, bytes]) -> None:
    c = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
    )
    c.create_bucket(Bucket=bucket)
    for k, v in keys.items():
        c.put_object(Bucket=bucket, Key=k, Body=v)


def revision(endpoint: str, uri: str, exclude=()) -> str:
    """The revision as the operator pins it (boto3 listing, the contract's selection and hasher)."""
    c = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
    )
    bucket, _ = contract.parse_source(uri)
    sel = contract.Selection.from_source(uri, exclude=exclude)
    h = contract.RevisionHasher()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=sel.prefix):
        for o in page.get("Contents", []):
            if sel.relative(o["Key"]) is not None:
                h.add(o["Key"], o["Size"], o["ETag"])
    return h.revision_id()


def stage(endpoint: str, uri: str, dest: Path, log: Path, exclude=(), **extra: str):
    env = {"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", **extra}
    argv = contract.StageArgs(
        source=uri,
        revision=revision(endpoint, uri, exclude),
        cache_dir=str(dest),
        endpoint_url=endpoint,
        exclude=tuple(exclude),
        termination_log=str(log),
    ).to_argv()
    return subprocess.run(
        [sys.executable, "-m", "dscache_stager", *argv], capture_output=True, text=True, env=env, timeout=120
    )


def test_hostile_keys_are_listed_and_nothing_escapes(moto_endpoint: str, tmp_path: Path):
    keys = {
        "h/ok.txt": b"fine",
        "h/../../escape.txt": b"evil",
        "h//abs/evil": b"evil",
        "h/a/./b": b"evil",
        "h/" + "n" * 300: b"long",
        "h/tab\there": b"odd",
    }
    put(moto_endpoint, "hostile", keys)
    work = tmp_path / "work"
    work.mkdir()
    r = stage(moto_endpoint, "s3://hostile/h/", work / "dest", tmp_path / "t")
    assert r.returncode == 5, r.stderr
    msg = (tmp_path / "t").read_text()
    assert msg.startswith("error: 5 object key(s) under s3://hostile/h/ cannot be written safely")
    for key, why in [
        ("h/../../escape.txt", "'..' segment"),
        ("h//abs/evil", "absolute path"),
        ("h/a/./b", "'.' segment"),
        ("h/tab\\there", "control character"),
        ("segment longer than 255 bytes", ""),
    ]:
        assert key in msg and why in msg
    assert "exclude" in msg  # says how to fix it
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        p.name for p in [work, work / "dest", tmp_path / "t", *(work / "dest").rglob("*")]
    )
    assert not list(tmp_path.rglob("escape.txt")) and not list(tmp_path.rglob("evil"))
    assert not list((work / "dest").rglob("complete"))


def test_file_directory_clash_is_refused(moto_endpoint: str, tmp_path: Path):
    put(moto_endpoint, "clash", {"c/x": b"file", "c/x/y": b"under it", "c/z": b""})
    r = stage(moto_endpoint, "s3://clash/c/", tmp_path / "dest", tmp_path / "t")
    assert r.returncode == 5, r.stderr
    assert "'c/x/y' (file and directory at once (x))" in (tmp_path / "t").read_text()


# A one-page revision is copied by onepage.py (with the native plane), else by sync.py: both name the clashes.
@pytest.mark.parametrize("onepage", ["1", "0"])
def test_clash_is_found_across_keys_listed_in_between(moto_endpoint: str, tmp_path: Path, onepage: str):
    # 'x.txt' and 'x-1/z' sort between 'x' and 'x/...': the stager keeps no set of every
    # file, only the files a later key can still sit under, so this is the case to prove.
    keys = {"c/x": b"file", "c/x-1/z": b"z", "c/x.txt": b"t", "c/x/e": b"", "c/x/y": b"under it"}
    put(moto_endpoint, f"clash3-{onepage}", keys)
    r = stage(moto_endpoint, f"s3://clash3-{onepage}/c/", tmp_path / "dest", tmp_path / "t", DSCACHE_ONEPAGE=onepage)
    assert r.returncode == 5, r.stderr
    msg = (tmp_path / "t").read_text()
    assert msg.startswith("error: 2 object key(s)"), msg
    assert "'c/x/y' (file and directory at once (x))" in msg and "'c/x/e' (file and directory at once (x))" in msg


def test_excluding_the_hostile_keys_lets_the_copy_through(moto_endpoint: str, tmp_path: Path):
    put(moto_endpoint, "clash2", {"c/x": b"file", "c/x/y": b"under it", "c/ok": b"ok"})
    r = stage(moto_endpoint, "s3://clash2/c/", tmp_path / "d", tmp_path / "t", exclude=["x/*"])
    assert r.returncode == 0, r.stderr
    rev = r.stdout.strip().splitlines()[-1].split('"revision": "')[1][:22]
    assert sorted(p.name for p in Path(contract.data_dir(str(tmp_path / "d"), rev)).iterdir()) == ["ok", "x"]

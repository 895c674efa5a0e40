"""Hostile keys. versitygw stores objects as files and cannot hold them, so
these run against moto's S3 server, which accepts any key, as real S3 does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.support.s3server import free_port


@pytest.fixture(scope="module")
def moto_endpoint():
    port = free_port()
    server = ThreadedMotoServer(port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def put(endpoint: str, bucket: str, keys: dict[str, bytes]) -> None:
    c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1")
    c.create_bucket(Bucket=bucket)
    for k, v in keys.items():
        c.put_object(Bucket=bucket, Key=k, Body=v)


def stage(endpoint: str, uri: str, dest: Path, log: Path):
    env = {"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}
    return subprocess.run([sys.executable, "-m", "dscache_stager", "sync", uri, str(dest), "--endpoint-url", endpoint,
                           "--termination-log", str(log)], capture_output=True, text=True, env=env, timeout=120)


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
    for key, why in [("h/../../escape.txt", "'..' segment"), ("h//abs/evil", "absolute path"),
                     ("h/a/./b", "'.' segment"), ("h/tab\\there", "control character"),
                     ("segment longer than 255 bytes", "")]:
        assert key in msg and why in msg
    assert "exclude" in msg  # says how to fix it
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        p.name for p in [work, work / "dest", tmp_path / "t"] + list((work / "dest").rglob("*")))
    assert not list(tmp_path.rglob("escape.txt")) and not list(tmp_path.rglob("evil"))
    assert not (work / "dest" / ".dscache" / "complete").exists()


def test_file_directory_clash_is_refused(moto_endpoint: str, tmp_path: Path):
    put(moto_endpoint, "clash", {"c/x": b"file", "c/x/y": b"under it", "c/z": b""})
    r = stage(moto_endpoint, "s3://clash/c/", tmp_path / "dest", tmp_path / "t")
    assert r.returncode == 5, r.stderr
    assert "'c/x/y' (file and directory at once (x))" in (tmp_path / "t").read_text()


def test_excluding_the_hostile_keys_lets_the_copy_through(moto_endpoint: str, tmp_path: Path):
    put(moto_endpoint, "clash2", {"c/x": b"file", "c/x/y": b"under it", "c/ok": b"ok"})
    env_args = ["--exclude", "x/*"]
    r = subprocess.run([sys.executable, "-m", "dscache_stager", "sync", "s3://clash2/c/", str(tmp_path / "d"),
                        "--endpoint-url", moto_endpoint, *env_args], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [".dscache", "ok", "x"]

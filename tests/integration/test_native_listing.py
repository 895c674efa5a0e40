"""The native plane's listing and HEADs (native/src/list.rs, dscache_stager.store) against the real
S3 server (issue 30: one S3 client on the common path): pages as S3 sends them, prefixes, the
access proof's empty page, a resumed listing, and the errors as the stager words them. A cold
stage on the common path that never imports obstore is at the end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dscache_stager import listpage
from dscache_stager.errors import SourceError
from dscache_stager.listpage import PAST_EVERY_KEY, empty_page, first_page
from dscache_stager.source import S3Source, source_error
from dscache_stager.store import NativeStore, kind, open_store
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server, free_port
from tests.support.stager import boto3_revision, data_dir, data_tree, expected_tree, stage_env, sync_argv

pytestmark = pytest.mark.integration

pytest.importorskip("dscache_native", reason="dscache_native is not installed (make wheels needs cargo)")

#: Three ListObjectsV2 pages (S3 sends at most 1,000 keys a page).
KEYS = [f"d/{i:05}" for i in range(2100)]
#: Around the prefix: keys before and after it, a sibling sharing its first letter (versitygw, on
#: files, cannot hold a key "d" beside "d/...").
OUTSIDE = ["c", "d2/x", "e/y"]


def _put_many(server: S3Server, bucket: str, keys: list[str]) -> None:
    client = server.client()
    with ThreadPoolExecutor(8) as pool:  # boto3's pool holds 10 connections
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=k.encode()), keys))


@pytest.fixture(scope="module")
def many(s3_server: S3Server) -> str:
    """A bucket of KEYS and OUTSIDE, filled once for the module (2,100 PUTs)."""
    name = "native-listing"
    s3_server.make_bucket(name)
    _put_many(s3_server, name, KEYS + OUTSIDE)
    return name


class Lists:
    """A FaultProxy policy that passes everything and keeps the request lines of ListObjectsV2."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, n: int, line: str) -> str:
        if re.match(r"^GET /\S*\?(\S*&)?list-type=2", line):
            with self.lock:
                self.lines.append(line)
        return "pass"


@pytest.fixture
def counted(s3_server: S3Server):
    lists = Lists()
    proxy = FaultProxy(upstream=(s3_server.host, s3_server.port), policy=lists).start()
    yield proxy.endpoint, lists
    proxy.stop()


@pytest.fixture
def creds(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("DSCACHE_NATIVE", raising=False)


def native(bucket: str, endpoint: str, prefix: str = "", retry_timeout: float = 120.0) -> NativeStore:
    store = open_store(S3Source(bucket, prefix, endpoint_url=endpoint, retry_timeout=retry_timeout), 8)
    assert isinstance(store, NativeStore), "static keys and the extension: the native client"
    return store


def boto3_listing(server: S3Server, bucket: str, prefix: str) -> list[tuple[str, int, str]]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [(o["Key"], o["Size"], o["ETag"].strip('"')) for p in pages for o in p.get("Contents", [])]


def test_a_listing_of_many_pages_is_boto3s_a_page_at_a_time(s3_server: S3Server, many: str, counted, creds):
    endpoint, lists = counted
    batches = list(native(many, endpoint).pages("d/", None, 1000))
    assert [len(b) for b in batches] == [1000, 1000, 100]
    assert [o for b in batches for o in b] == boto3_listing(s3_server, many, "d/")
    assert [k for b in batches for k, _, _ in b] == KEYS  # the prefix's keys only, in S3's order
    assert len(lists.lines) == 3  # one request a page: S3's pages, chunked as they come


def test_the_first_page_is_handed_on_and_the_rest_goes_on_from_it(s3_server: S3Server, many: str, counted, creds):
    endpoint, lists = counted
    started = first_page(native(many, endpoint), "d/")
    assert [k for k, _, _ in started.first] == KEYS[:1000]
    assert len(lists.lines) == 1
    assert started.rest is not None
    rest = [k for b in started.rest for k, _, _ in b]  # type: ignore[union-attr]  # the native pages
    assert rest == KEYS[1000:]
    assert len(lists.lines) == 3  # no page listed twice
    assert "continuation-token" in lists.lines[1] and "continuation-token" in lists.lines[2]


def test_a_listing_resumes_after_a_key(many: str, creds, s3_server: S3Server):
    got = [k for b in native(many, s3_server.endpoint).pages("d/", KEYS[1499], 1000) for k, _, _ in b]
    assert got == KEYS[1500:]


def test_the_empty_page_starts_after_every_key_and_lists_nothing(many: str, counted, creds):
    endpoint, lists = counted
    store = native(many, endpoint)
    assert list(store.pages("d/", "d/" + PAST_EVERY_KEY, 1)) == []
    empty_page(store, "d/")  # the access proof: no error, nothing listed
    proof = "start-after=" + urllib.parse.quote("d/" + PAST_EVERY_KEY, safe="")
    assert len(lists.lines) == 2 and all(proof in line for line in lists.lines), lists.lines


def test_an_empty_prefix_and_a_whole_bucket(many: str, creds, s3_server: S3Server, bucket: str):
    store = native(many, s3_server.endpoint)
    assert list(store.pages("nothing/", None, 1000)) == []
    assert first_page(store, "nothing/").first == []
    whole = [k for b in store.pages("", None, 1000) for k, _, _ in b]
    assert whole == sorted(KEYS + OUTSIDE)
    assert list(native(bucket, s3_server.endpoint).pages("", None, 1000)) == []  # an empty bucket


def test_head_says_whether_a_key_exists(many: str, creds, s3_server: S3Server):
    store = native(many, s3_server.endpoint)
    assert store.head("d/00007") is True
    assert store.head("d/missing") is False
    assert store.head("c") is True
    assert store.head("d") is False  # a "directory" only


def test_wrong_credentials_are_access_denied(many: str, creds, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    # A listing's 403 is retried as any generic error is (as with obstore): two tries, not eight.
    monkeypatch.setattr(listpage, "LIST_ATTEMPTS", 2)
    source = S3Source(many, "d/", endpoint_url=s3_server.endpoint)
    store = native(many, s3_server.endpoint, "d/")
    for attempt in (lambda: first_page(store, "d/"), lambda: empty_page(store, "d/"), lambda: store.head("d/00001")):
        with pytest.raises(Exception) as e:
            attempt()
        # A listing's 403 comes as object_store words it (a generic error naming the status), as
        # obstore raised it: source_error reads either.
        assert kind(e.value) is not None, e.value
        err = source_error(e.value, source, 0)
        assert isinstance(err, SourceError) and "access denied to s3://native-listing/d/" in str(err), err


def test_no_such_bucket_is_said_at_once(creds, s3_server: S3Server):
    source = S3Source("no-such-bucket-here", "", endpoint_url=s3_server.endpoint)
    store = native("no-such-bucket-here", s3_server.endpoint)
    with pytest.raises(Exception) as e:
        first_page(store, "")
    assert kind(e.value) is not None and "NoSuchBucket" in str(e.value)
    err = source_error(e.value, source, 0)
    assert isinstance(err, SourceError) and str(err).startswith("no such bucket: no-such-bucket-here"), err


def test_an_endpoint_that_does_not_answer_cannot_be_reached(creds):
    endpoint = f"http://127.0.0.1:{free_port()}"
    source = S3Source("b", "", endpoint_url=endpoint, retry_timeout=0.5)
    store = native("b", endpoint, retry_timeout=0.5)
    with pytest.raises(Exception) as e:
        store.head("k")
    assert kind(e.value) == "generic"
    err = source_error(e.value, source, 0)
    assert isinstance(err, SourceError) and "cannot reach the S3 endpoint" in str(err), err


def test_a_cold_stage_on_the_common_path_never_imports_obstore(s3_server: S3Server, bucket: str, tmp_path: Path):
    """`dscache-stage sync` as the init container runs it (static keys, the native module), in a
    child that says at exit which S3 clients it imported; and the copy is whole."""
    files = {"p/a.bin": b"a" * 3000, "p/b/c.bin": b"c" * 2_000_000, "p/empty": b"", "p/dir/": b""}
    s3_server.put_tree(bucket, files)
    uri = f"s3://{bucket}/p/"
    rev = boto3_revision(s3_server, uri)
    argv = [*sync_argv(uri, tmp_path / "c", rev), "--endpoint-url", s3_server.endpoint]
    code = f"""
import json, os, sys
sys.argv = ["dscache-stage", *{argv!r}]
from dscache_stager.cli import main
code = main(owns_process=True)
clients = sorted(m for m in sys.modules if m.split(".")[0] in ("obstore", "dscache_native", "boto3"))
print(json.dumps(clients), file=sys.stderr, flush=True)
sys.stdout.flush()
os._exit(code)  # as cli.entry leaves
"""
    env = stage_env(s3_server)
    env.pop("DSCACHE_NATIVE", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stderr.strip().splitlines()[-1])
    assert loaded == ["dscache_native", "dscache_native.dscache_native"], loaded
    assert data_tree(data_dir(tmp_path / "c", rev)) == expected_tree(files, "p/")

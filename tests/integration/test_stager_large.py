"""Large objects on the native plane (issue 30): ranged parts in parallel, pwritev into one
temp file, the pin, rename; against the real S3 server, through a fault proxy where a part
must fail. The stager's own runs go through the CLI on both data planes (the python one is
the fallback: fetch.py's ranged parts)."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

import dscache_contract as contract
from dscache_stager import native
from dscache_stager.source import S3Source
from dscache_stager.store import PreconditionError
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server
from tests.support.stager import boto3_revision, data_dir, run_stage, stage_cmd, stage_env, sync_argv

pytestmark = pytest.mark.integration

PART = 1 << 20
#: Four parts, the last one half a part (still more than the proxy's first chunk, which it passes before a cut).
BODY_SIZE = 3 * PART + PART // 2


def copier(
    server: S3Server,
    bucket: str,
    tmp: Path,
    endpoint: str | None = None,
    config: dict[str, str] | None = None,
    splice: bool | None = None,
) -> native.NativeFetcher:
    if os.environ.get(native.ENV) == "0":
        pytest.skip("drives the native copier itself: once, on the native plane")
    module = pytest.importorskip("dscache_native")
    tmp.mkdir(exist_ok=True)
    source = S3Source(bucket, "", endpoint_url=endpoint or server.endpoint, retry_timeout=5)
    return native.NativeFetcher(
        module, source, 8, workers=2, tmp_dir=str(tmp), part_bytes=PART, config=config, splice=splice
    )


def fetch_large(fetcher: native.NativeFetcher, item: native.Item, on_bytes=None) -> object:
    async def go() -> object:
        try:
            return await asyncio.wait_for(fetcher.fetch_large(item, on_bytes), 120)
        except Exception as e:
            return e

    return asyncio.run(go())


@pytest.fixture
def env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def body(s3_server: S3Server, bucket: str, env: None) -> tuple[bytes, str]:
    data = os.urandom(BODY_SIZE)
    s3_server.put_tree(bucket, {"big": data})
    etag = s3_server.client().head_object(Bucket=bucket, Key="big")["ETag"].strip('"')
    return data, etag


SPLICE = pytest.mark.parametrize("splice", [True, False], ids=["splice", "stream"])


@SPLICE
def test_a_large_object_arrives_whole_in_parts_and_read_only(
    s3_server: S3Server, bucket: str, body: tuple[bytes, str], tmp_path: Path, splice: bool
):
    """Both ways of writing a part: splice(2) from a presigned URL (plain HTTP) and pwritev of the stream."""
    data, etag = body
    fetcher = copier(s3_server, bucket, tmp_path / "tmp", splice=splice)
    progress: list[int] = []
    try:
        got = fetch_large(fetcher, ("big", str(tmp_path / "out"), etag, None, len(data)), progress.append)
        counters = fetcher.counters()
    finally:
        fetcher.close()
    assert not isinstance(got, BaseException), got
    assert (got.size, got.etag) == (len(data), etag)
    assert (tmp_path / "out").read_bytes() == data
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o444
    assert os.listdir(tmp_path / "tmp") == []
    assert sum(progress) == len(data)  # the progress line heard of every part, once
    assert counters == {
        "large_objects": 1,
        "large_parts": 4,
        "parts_retried": 0,
        "spliced_parts": 4 * splice,
        "large_bytes": BODY_SIZE,
    }


def test_a_named_endpoint_is_spliced(s3_server: S3Server, bucket: str, body: tuple[bytes, str], tmp_path: Path):
    """The splice path by host name (large.rs resolves it once per object and tries every address
    in order; localhost may list ::1, where the server does not listen, before 127.0.0.1)."""
    data, etag = body
    named = s3_server.endpoint.replace("127.0.0.1", "localhost")
    assert named != s3_server.endpoint
    fetcher = copier(s3_server, bucket, tmp_path / "tmp", endpoint=named, splice=True)
    try:
        got = fetch_large(fetcher, ("big", str(tmp_path / "out"), etag, None, len(data)))
        counters = fetcher.counters()
    finally:
        fetcher.close()
    assert not isinstance(got, BaseException), got
    assert (tmp_path / "out").read_bytes() == data
    assert (counters["spliced_parts"], counters["parts_retried"]) == (4, 0)


@SPLICE
def test_the_pin_refuses_other_bytes_and_leaves_nothing(
    s3_server: S3Server, bucket: str, body: tuple[bytes, str], tmp_path: Path, splice: bool
):
    data, _ = body
    fetcher = copier(s3_server, bucket, tmp_path / "tmp", splice=splice)
    try:
        got = fetch_large(fetcher, ("big", str(tmp_path / "out"), "0" * 32, None, len(data)))
    finally:
        fetcher.close()
    assert isinstance(got, PreconditionError), got
    assert not (tmp_path / "out").exists()
    assert os.listdir(tmp_path / "tmp") == []


def test_a_pinned_version_is_read_after_an_overwrite(
    versioned_s3: S3Server, versioned_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    for name, value in versioned_s3.env.items():
        monkeypatch.setenv(name, value)
    old, new = os.urandom(BODY_SIZE), os.urandom(BODY_SIZE)
    client = versioned_s3.client()
    first = client.put_object(Bucket=versioned_bucket, Key="big", Body=old)
    client.put_object(Bucket=versioned_bucket, Key="big", Body=new)
    # A plain-HTTP endpoint, yet a pinned version streams: a presigned URL cannot name it.
    fetcher = copier(versioned_s3, versioned_bucket, tmp_path / "tmp", splice=True)
    try:
        item = ("big", str(tmp_path / "out"), first["ETag"].strip('"'), first["VersionId"], BODY_SIZE)
        got = fetch_large(fetcher, item)
        counters = fetcher.counters()
    finally:
        fetcher.close()
    assert not isinstance(got, BaseException), got
    assert (tmp_path / "out").read_bytes() == old
    assert (counters["large_parts"], counters["spliced_parts"]) == (4, 0)


@SPLICE
@pytest.mark.parametrize("fault", ["short", "reset"])
def test_a_failed_or_short_part_is_tried_again_on_its_own(
    s3_server: S3Server, bucket: str, body: tuple[bytes, str], tmp_path: Path, fault: str, splice: bool
):
    """Every part's first answer is cut (a clean close: a short read; or a reset) with the S3
    client's own retries off: the copier tries each part again itself, and only that part."""
    data, etag = body
    # Ranged GETs of one object share a request line: cut the first four (one per part).
    cuts = iter(range(4))

    def first_four(n: int, line: str) -> str:
        return fault if next(cuts, None) is not None else "pass"

    proxy = FaultProxy((s3_server.host, s3_server.port), first_four).start()
    fetcher = copier(
        s3_server, bucket, tmp_path / "tmp", endpoint=proxy.endpoint, config={"max_retries": "0"}, splice=splice
    )
    try:
        got = fetch_large(fetcher, ("big", str(tmp_path / "out"), etag, None, len(data)))
        counters = fetcher.counters()
    finally:
        fetcher.close()
        proxy.stop()
    assert not isinstance(got, BaseException), got
    assert (tmp_path / "out").read_bytes() == data
    assert proxy.counts.get(fault) == 4
    assert counters == {
        "large_objects": 1,
        "large_parts": 4,
        "parts_retried": 4,
        "spliced_parts": 4 * splice,
        "large_bytes": BODY_SIZE,
    }
    assert proxy.counts.get("pass") == 4  # each cut part asked for again once, no more


def test_the_cli_copies_large_objects_on_the_chosen_plane(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    """The real CLI: the native plane takes the large object in ranged parts (and says so), the
    python plane (the fallback) copies it with fetch.py's parts; the same bytes either way."""
    from dscache_stager.fetch import PART_SIZE

    data = os.urandom(2 * PART_SIZE + 777)
    small = os.urandom(5000)
    s3_server.put_tree(bucket, {"mix/big.bin": data, "mix/small.bin": small})
    uri, cache = f"s3://{bucket}/mix/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    r = run_stage(s3_server, *sync_argv(uri, cache, rev))
    assert r.code == 0, r.stderr
    assert (data_dir(cache, rev) / "big.bin").read_bytes() == data
    assert (data_dir(cache, rev) / "small.bin").read_bytes() == small
    said = "native data plane: 1 large object(s) in 3 ranged parts, 0 part(s) tried again"
    assert (said in r.stderr) == (data_plane == "native"), r.stderr


def test_a_run_killed_mid_object_resumes_to_the_exact_bytes(
    s3_server: S3Server, bucket: str, tmp_path: Path, data_plane: str
):
    """SIGKILL while a large object's parts are in flight (each request held 1 s by the proxy):
    its temp file is left behind, never renamed; the next run copies it again, whole."""
    data = os.urandom(40 << 20)
    s3_server.put_tree(bucket, {"k/big.bin": data})
    uri, cache = f"s3://{bucket}/k/", tmp_path / "c"
    rev = boto3_revision(s3_server, uri)
    tmp = Path(contract.revision_dir(str(cache), rev)) / "tmp"
    proxy = FaultProxy((s3_server.host, s3_server.port), lambda n, line: "pass", hold_s=1.0).start()
    argv = [*sync_argv(uri, cache, rev), "--endpoint-url", proxy.endpoint]
    try:
        p = subprocess.Popen(stage_cmd(*argv), env=stage_env(s3_server), stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        # The temp file exists (named by the pid) while the parts are held at the proxy.
        while time.monotonic() < deadline and p.poll() is None:
            if tmp.exists() and [f for f in os.listdir(tmp) if f.startswith(f"{p.pid}-")]:
                break
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        proxy.stop()
    assert p.returncode == -signal.SIGKILL
    assert not (data_dir(cache, rev) / "big.bin").exists()
    final = run_stage(s3_server, *sync_argv(uri, cache, rev))
    assert final.code == 0, final.stderr
    assert (data_dir(cache, rev) / "big.bin").read_bytes() == data
    assert not tmp.exists()


@pytest.mark.parametrize(
    ("tmpfile", "link"),
    [("1", ""), ("1", "proc"), ("0", "")],
    ids=["unnamed-file", "unnamed-file-proc-link", "temp-rename"],
)
def test_small_objects_replace_what_a_killed_run_left_and_leave_tmp_empty(
    s3_server: S3Server,
    bucket: str,
    tmp_path: Path,
    env: None,
    monkeypatch: pytest.MonkeyPatch,
    tmpfile: str,
    link: str,
):
    """Small objects go into unnamed files linked into place (O_TMPFILE) by their descriptor, or
    through /proc/self/fd (DSCACHE_NATIVE_LINK=proc: kernels before 6.10), or by temp file +
    rename (DSCACHE_NATIVE_TMPFILE=0): either way a stale file, or a stale directory where the
    bucket now has a file, is replaced by the object's bytes, read-only, and nothing is left in
    tmp/. Bodies up to the small limit arrive in several chunks, written as they came (one writev)."""
    monkeypatch.setenv(native.TMPFILE_ENV, tmpfile)
    monkeypatch.setenv(native.LINK_ENV, link)
    files = {f"d/f{i}": os.urandom(1000 + i) for i in range(20)}
    files |= {"d/g0": os.urandom((256 << 10) + 7), "d/g1": os.urandom(1 << 20)}
    s3_server.put_tree(bucket, files)
    out = tmp_path / "out"
    (out / "d").mkdir(parents=True)
    (out / "d" / "f0").write_bytes(b"stale")  # what a killed run of an older listing placed
    (out / "d" / "f1").mkdir()
    (out / "d" / "f1" / "x").write_bytes(b"a directory where the bucket now has a file")
    fetcher = copier(s3_server, bucket, tmp_path / "tmp")
    try:
        items = [(key, str(out / key), "", None, len(body)) for key, body in files.items()]
        placed, failure = asyncio.run(asyncio.wait_for(fetcher.fetch(items), 60))
    finally:
        fetcher.close()
    assert failure is None, failure
    assert len(placed) == len(files)
    for key, body in files.items():
        assert (out / key).read_bytes() == body, key
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o444
    assert sorted(os.listdir(out / "d")) == sorted(k.split("/")[1] for k in files)
    assert os.listdir(tmp_path / "tmp") == []


@pytest.mark.parametrize("tmpfile", ["1", "0"], ids=["unnamed-file", "temp-rename"])
def test_after_close_no_file_is_written_and_none_is_partial(
    s3_server: S3Server, bucket: str, tmp_path: Path, env: None, monkeypatch: pytest.MonkeyPatch, tmpfile: str
):
    """A batch cancelled mid-way (the run failed elsewhere): once close() returns, no thread of the
    copier creates or links a file any more (sync.py removes the revision right after); every file
    that was placed is whole, and nothing is left in tmp/."""
    monkeypatch.setenv(native.TMPFILE_ENV, tmpfile)
    files = {f"c/f{i:03d}": os.urandom(64 << 10) for i in range(300)}
    s3_server.put_tree(bucket, files)
    out = tmp_path / "out"
    (out / "c").mkdir(parents=True)
    fetcher = copier(s3_server, bucket, tmp_path / "tmp")
    items = [(key, str(out / key), "", None, len(body)) for key, body in files.items()]

    async def go() -> None:
        job = asyncio.ensure_future(fetcher.fetch(items))
        while not os.listdir(out / "c") and not job.done():
            await asyncio.sleep(0.001)
        fetcher.close()  # the run failed elsewhere: on the loop's thread, as sync.py's finally does
        await asyncio.wait_for(job, 60)

    asyncio.run(go())
    after_close = sorted(os.listdir(out / "c"))
    time.sleep(0.5)
    assert sorted(os.listdir(out / "c")) == after_close
    for name in after_close:
        assert (out / "c" / name).read_bytes() == files[f"c/{name}"], name
    assert os.listdir(tmp_path / "tmp") == []

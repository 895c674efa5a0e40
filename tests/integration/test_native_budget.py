"""The native data plane's byte budget (issue 18): bodies in memory are bounded by
``buffer_bytes`` (sync_options.BUFFER_BYTES, 64 MiB in the stager), not by the request count.

A real Copier copies from the real S3 server through a proxy that holds every request
100 ms and counts the requests held at once (before any byte of their answers: a body
given back and a new GET sent the next instant is not counted beside it). The budget is
reserved before an object's GET and given back once its body is written, so no more
objects than the budget holds can ever be held at once; the same copy with a budget that does not bind shows the proxy does see
the concurrency the requests limit allows."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from dscache_stager import native
from dscache_stager.source import S3Source
from tests.support.faultproxy import FaultProxy
from tests.support.s3server import S3Server

pytestmark = pytest.mark.integration

SIZE = 64 << 10
COUNT = 32
CONCURRENCY = 32


def copy_through_counter(
    server: S3Server, bucket: str, files: dict[str, bytes], dest: Path, buffer_bytes: int
) -> tuple[int, int]:
    """Copy ``files`` in one native batch; (the proxy's peak of GETs in flight, objects placed)."""
    module = pytest.importorskip("dscache_native")
    proxy = FaultProxy((server.host, server.port), lambda n, line: "pass", hold_s=0.1).start()
    dest.mkdir()
    (dest / "tmp").mkdir()
    try:
        source = S3Source(bucket, "", endpoint_url=proxy.endpoint)
        fetcher = native.NativeFetcher(
            module, source, CONCURRENCY, workers=2, tmp_dir=str(dest / "tmp"), buffer_bytes=buffer_bytes
        )
        try:
            items = [(key, str(dest / key), "", None, len(body)) for key, body in files.items()]
            placed, failure = asyncio.run(asyncio.wait_for(fetcher.fetch(items), 60))
        finally:
            fetcher.close()
    finally:
        proxy.stop()
    assert failure is None, failure
    for key, body in files.items():
        assert (dest / key).read_bytes() == body, key
    return proxy.peak_in_flight, len(placed)


@pytest.fixture
def objects(s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    rng = random.Random(18)
    files = {f"o{i:02d}": rng.randbytes(SIZE) for i in range(COUNT)}
    s3_server.put_tree(bucket, files)
    return files


def test_bodies_in_flight_never_exceed_the_byte_budget(
    s3_server: S3Server, bucket: str, objects: dict[str, bytes], tmp_path: Path
):
    # Four objects' worth: the 32 allowed requests must queue on the bytes.
    peak, placed = copy_through_counter(s3_server, bucket, objects, tmp_path / "budget", buffer_bytes=4 * SIZE)
    assert placed == COUNT
    assert peak == 4, f"{peak} GETs in flight under a budget of 4 objects"
    # The stager's own budget (64 MiB) does not bind 32 x 64 KiB: the requests limit does,
    # and the proxy sees it (so the bound above is the budget's, not the proxy's).
    peak, placed = copy_through_counter(s3_server, bucket, objects, tmp_path / "open", buffer_bytes=64 << 20)
    assert placed == COUNT
    assert peak > 8, f"only {peak} GETs in flight with the budget open: the proxy cannot see the concurrency"


def test_an_object_larger_than_the_budget_still_copies_alone(
    s3_server: S3Server, bucket: str, objects: dict[str, bytes], tmp_path: Path
):
    # A budget below one object: each object takes the whole budget (clamped), one at a time.
    few = dict(list(objects.items())[:4])
    peak, placed = copy_through_counter(s3_server, bucket, few, tmp_path / "one", buffer_bytes=SIZE // 2)
    assert (placed, peak) == (4, 1)

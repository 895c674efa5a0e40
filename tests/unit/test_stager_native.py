"""dscache_native's seam with the stager: settings, credentials and how its failures are raised.

The copies themselves run against the real S3 server in tests/integration
(every test_stager_* test runs on both data planes)."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time

import pytest

from dscache_stager import native
from dscache_stager.errors import SourceError
from dscache_stager.fetch import ObjectGone
from dscache_stager.source import S3Source, source_error
from dscache_stager.store import (
    GenericError,
    NativeStore,
    PermissionDeniedError,
    PreconditionError,
    StoreError,
    UnauthenticatedError,
    list_async,
)


def test_failures_are_raised_as_the_python_path_raises_them():
    e = native._exception("gone", 0, "Object at location k not found", "data/k")
    assert isinstance(e, ObjectGone) and str(e) == "data/k"
    assert isinstance(native._exception("precondition", 0, "412", "k"), PreconditionError)
    assert isinstance(native._exception("permission", 0, "403", "k"), PermissionDeniedError)
    assert isinstance(native._exception("unauthenticated", 0, "401", "k"), UnauthenticatedError)
    assert isinstance(native._exception("generic", 0, "500", "k"), GenericError)
    assert isinstance(native._exception("cancelled", 0, "", "k"), asyncio.CancelledError)
    full = native._exception("os", errno.ENOSPC, "writing /c/tmp/1-n1", "k")
    assert isinstance(full, OSError) and full.errno == errno.ENOSPC


def test_the_switch(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(native.ENV, "0")
    assert native.load() is None
    monkeypatch.setenv("DSCACHE_NATIVE_WORKERS", "3")
    assert native.threads(8) == 3
    monkeypatch.delenv("DSCACHE_NATIVE_WORKERS")
    assert native.threads(8) == 8
    assert native.handles(1) and native.handles(1 << 20) and not native.handles(0) and not native.handles((1 << 20) + 1)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_reads_as_the_python_path_reports_it(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A real Copier (store_settings as the stager builds them) against a closed port: the
    failure carries object_store's error chain, which source_error reads ("connect")."""
    module = pytest.importorskip("dscache_native")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.delenv(native.ENV, raising=False)
    source = S3Source("b", "p/", endpoint_url=f"http://127.0.0.1:{closed_port()}", retry_timeout=0.5)
    fetcher = native.NativeFetcher(module, source, concurrency=4, workers=2, tmp_dir=str(tmp_path))
    try:
        assert fetcher.workers == 2
        placed, failure = asyncio.run(fetcher.fetch([("p/a", str(tmp_path / "a"), "e", None, 1)]))
    finally:
        fetcher.close()
    assert placed == [] and isinstance(failure, GenericError)
    err = source_error(failure, source, 0)
    assert isinstance(err, SourceError) and "cannot reach the S3 endpoint" in str(err)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_large_object_that_cannot_be_read_raises_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """fetch_large answers once per object: the failure raised as fetch.py raises it, no temp file left."""
    module = pytest.importorskip("dscache_native")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    source = S3Source("b", "p/", endpoint_url=f"http://127.0.0.1:{closed_port()}", retry_timeout=0.5)
    fetcher = native.NativeFetcher(module, source, concurrency=4, workers=2, tmp_dir=str(tmp_path), part_bytes=1 << 20)
    try:
        with pytest.raises(GenericError):
            asyncio.run(fetcher.fetch_large(("p/a", str(tmp_path / "a"), "e", None, 5 << 20)))
        counters = fetcher.counters()
        assert counters["spliced_parts"] == 0
        # A part is tried as often as fetch.py tries an object (4 more times) before the object
        # fails; the first part to give up stops the others, wherever they are.
        assert (counters["large_objects"], counters["large_parts"]) == (0, 0)
        assert 4 <= counters["parts_retried"] <= 5 * 4, counters
    finally:
        fetcher.close()
    assert list(tmp_path.iterdir()) == []


def _silent_endpoint(sock: socket.socket) -> str:
    """An endpoint that takes connections (the kernel's backlog) and never answers a request."""
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_native_page_in_flight_is_cancelled_at_once():
    """Pages.cancel, from another thread, ends a page S3 does not answer (the client would wait
    TIMEOUT_S = 300 s): next() raises at once."""
    module = pytest.importorskip("dscache_native")
    with socket.socket() as silent:
        source = S3Source("b", "p/", endpoint_url=_silent_endpoint(silent))
        client = NativeStore(module.Store("b", source.store_settings(4), access_key_id="k", secret_access_key="s"))
        pages = client.pages("p/", None, 1000)
        threading.Timer(0.3, pages.cancel).start()
        started = time.monotonic()
        with pytest.raises(StoreError, match="cancelled"):
            next(pages)
        assert 0.25 < time.monotonic() - started < 5
        with pytest.raises(StopIteration):
            next(pages)  # the listing is over


def test_an_abandoned_listing_leaves_no_thread_waiting_on_s3():
    """A listing task cancelled while its page is in flight (the run failed elsewhere): the page's
    thread ends with it, so asyncio.run (which waits for its threads) returns at once."""
    module = pytest.importorskip("dscache_native")

    async def abandon(client: NativeStore) -> None:
        async def consume() -> None:
            async for _ in list_async(client, "p/", None, 1000):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with socket.socket() as silent:
        source = S3Source("b", "p/", endpoint_url=_silent_endpoint(silent))
        client = NativeStore(module.Store("b", source.store_settings(4), access_key_id="k", secret_access_key="s"))
        # On a thread of its own, so that a run left waiting on S3 fails the test instead of hanging it.
        run = threading.Thread(target=asyncio.run, args=(abandon(client),), daemon=True)
        run.start()
        run.join(timeout=10)
        assert not run.is_alive(), "asyncio.run still waits for the listing's thread"

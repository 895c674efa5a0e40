"""Which cold copy runs (onepage.fits), and that the one without asyncio imports none of it.

A one-page revision (the access proof's page was the whole listing, no peers, no --as-of,
the native plane; large objects too, in ranged parts) is copied on this thread (onepage.py);
everything else by sync.py. The copies themselves run against a real S3 server in
tests/integration/test_stager_onepage.py."""

from __future__ import annotations

import json
import subprocess
import sys
from types import ModuleType

import pytest

from dscache_stager import native, onepage
from dscache_stager.listpage import Started
from dscache_stager.objects import SMALL_LIMIT
from dscache_stager.source import S3Source
from dscache_stager.sync_options import SyncOptions


def _opts(**kw: object) -> SyncOptions:
    src = S3Source.parse("s3://b/p/", endpoint_url="http://127.0.0.1:9")
    return SyncOptions(src, "/tmp/c", "r-0123456789abcdef0123", **kw)  # type: ignore[arg-type]


ONE_PAGE = Started([("p/a", 1, "e1"), ("p/b/", 0, ""), ("p/c", SMALL_LIMIT, "e3")], None)


@pytest.fixture
def native_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "load", lambda: ModuleType("dscache_native"))
    monkeypatch.delenv(onepage.ENV, raising=False)


def test_a_one_page_revision_without_peers_is_copied_without_asyncio(native_loads: None) -> None:
    assert onepage.fits(_opts(), ONE_PAGE)
    assert onepage.fits(_opts(), Started([], None))  # an empty revision too
    # Large objects too: the native copier's ranged parts, one blocking fetch_large each.
    assert onepage.fits(_opts(), Started([*ONE_PAGE.first, ("p/l", SMALL_LIMIT + 1, "e")], None))


@pytest.mark.parametrize(
    "why, opts, listing",
    [
        ("no listing page (a warm probe, keys the client refused)", {}, None),
        ("more pages to come", {}, Started(ONE_PAGE.first, iter([]))),  # type: ignore[arg-type]
        ("--as-of", {"as_of": "2026-01-01T00:00:00Z"}, ONE_PAGE),
        ("peers", {"agent": "https://agent:8443", "cache": "ns/c", "peer_token_file": "/t"}, ONE_PAGE),
    ],
)
def test_anything_else_goes_to_sync(native_loads: None, why: str, opts: dict[str, object], listing: Started) -> None:
    assert not onepage.fits(_opts(**opts), listing), why


def test_without_the_native_plane_or_when_switched_off_sync_copies(
    native_loads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(onepage.ENV, "0")
    assert not onepage.fits(_opts(), ONE_PAGE)
    monkeypatch.setenv(onepage.ENV, "1")
    monkeypatch.setattr(native, "load", lambda: None)
    assert not onepage.fits(_opts(), ONE_PAGE)


# Everything a one-page cold copy imports: the CLI, the access proof's modules, what the cold-path
# thread imports (stage._import_cold_path) and the copy's own modules.
ONE_PAGE_IMPORTS = """
import json, sys
from dscache_stager import cli, copyrun, listpage, native, onepage, stage, store
stage._import_cold_path()
native.load()
print(json.dumps(sorted(sys.modules)))
"""


def test_the_one_page_path_imports_no_asyncio() -> None:
    out = subprocess.run([sys.executable, "-c", ONE_PAGE_IMPORTS], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert "dscache_stager.onepage" in loaded and "dscache_stager.copyrun" in loaded  # the probe did import them
    assert sorted(m for m in loaded if m.split(".")[0] in ("asyncio", "_asyncio", "ssl", "_ssl")) == []
    assert "dscache_stager.sync" not in loaded and "dscache_stager.fetch" not in loaded

"""The stager's integration tests run against both data planes (issue 18):
``native`` (dscache_native, built by `make wheels`) and ``python`` (fetch.py,
the fallback when the extension is absent). The stager runs as a child
process, so the choice travels in DSCACHE_NATIVE (dscache_stager.native)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

DATA_PLANES = ["native", "python"]


def native_installed() -> bool:
    return importlib.util.find_spec("dscache_native") is not None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.module.__name__.rsplit(".", 1)[-1].startswith("test_stager_") and "data_plane" in metafunc.fixturenames:
        metafunc.parametrize("data_plane", DATA_PLANES, indirect=True)


@pytest.fixture(autouse=True)
def data_plane(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str | None]:
    plane = getattr(request, "param", None)
    if plane == "native" and not native_installed():
        pytest.skip("dscache_native is not installed (make wheels needs cargo)")
    if plane is not None:
        monkeypatch.setenv("DSCACHE_NATIVE", "1" if plane == "native" else "0")
    yield plane

"""uv.lock is the one lock: it matches pyproject.toml, and the images' requirements are its exports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UV = Path(sys.executable).parent / "uv"
EXPORTS = {"operator": REPO / "operator" / "requirements.txt", "stager": REPO / "init-container" / "requirements.txt"}


@pytest.fixture(scope="module")
def uv() -> str:
    found = str(UV) if UV.exists() else shutil.which("uv")
    if not found:
        pytest.skip("uv is not installed (it is a dev dependency: `make install`)")
    return found


def test_lock_matches_pyproject(uv: str):
    proc = subprocess.run([uv, "lock", "--check", "--offline"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"uv.lock does not match pyproject.toml: run `make lock`\n{proc.stderr}"


@pytest.mark.parametrize("extra", sorted(EXPORTS))
def test_image_requirements_are_the_locks_export(uv: str, extra: str):
    proc = subprocess.run(
        [uv, "export", "--frozen", "--no-emit-project", "--quiet", "--no-dev", "--extra", extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    body = [line for line in proc.stdout.splitlines() if not line.startswith("#")]
    committed = [line for line in EXPORTS[extra].read_text().splitlines() if not line.startswith("#")]
    assert committed == body, f"{EXPORTS[extra].relative_to(REPO)} is stale: run `make lock`"
    pins = [line for line in body if "==" in line]
    # Every requirement is pinned and followed by its hashes (the Dockerfiles use --require-hashes).
    assert pins and all(line.rstrip().endswith("\\") for line in pins), pins

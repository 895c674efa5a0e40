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


#: Import name -> distribution, for the third-party modules the shipped packages import.
DISTRIBUTIONS = {
    "google": "protobuf",
    "grpc": "grpcio",
    "jwt": "pyjwt",
    "prometheus_client": "prometheus-client",
    "yaml": "pyyaml",
}
#: What each image installs from its requirements, and the packages it ships.
IMAGES = {
    "stager": ["init-container/dscache_stager", "node-agent/dscache_node", "contract/dscache_contract"],
    "operator": ["operator/dscache_operator", "contract/dscache_contract"],
}
#: Developer tools inside a shipped package, never run in an image (grpcio-tools is a dev dependency).
DEV_ONLY = {"node-agent/dscache_node/csi/regen.py"}


@pytest.mark.parametrize("extra", sorted(IMAGES))
def test_every_import_of_an_image_is_in_its_requirements(extra: str):
    """An image installs its extra's export only: a module its code imports must be in it
    (the node agent's server once imported aiohttp, which only the operator's extra had)."""
    import ast

    ours = {"dscache_stager", "dscache_node", "dscache_operator", "dscache_contract", "dscache_native"}
    wanted: dict[str, str] = {}
    for package in IMAGES[extra]:
        for path in (REPO / package).rglob("*.py"):
            if "_gen" in path.parts or str(path.relative_to(REPO)) in DEV_ONLY:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    else []
                )
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours and top != "__future__":
                        wanted.setdefault(DISTRIBUTIONS.get(top, top).lower(), str(path.relative_to(REPO)))
    have = {line.split("==")[0].strip().lower() for line in EXPORTS[extra].read_text().splitlines() if "==" in line}
    missing = {dist: where for dist, where in wanted.items() if dist not in have}
    assert not missing, (
        f"imported but not in {EXPORTS[extra].relative_to(REPO)} (add to the [{extra}] extra): {missing}"
    )

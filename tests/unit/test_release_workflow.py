""".github/workflows/release.yml: actionlint-clean, gated on lint and the unit tests, and it
publishes what the repository builds: the stager's image with the native data plane compiled
in for each architecture, never a pure-Python fallback."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.support.tools import REPO, built_tool_bin

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"
STAGER_DOCKERFILE = REPO / "init-container" / "Dockerfile"
IMAGES_SH = REPO / "e2e" / "tools" / "images.sh"


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _commands(script: str) -> list[list[str]]:
    """The command lines of a `run:` script, as words; comments and blank lines dropped."""
    return [shlex.split(line, comments=True) for line in script.splitlines() if shlex.split(line, comments=True)]


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction: continuations joined, comment lines dropped."""
    lines = [ln for ln in dockerfile.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def _stages(dockerfile: str) -> list[dict]:
    """Each stage: its base image, its name (or None) and its instructions after FROM."""
    stages: list[dict] = []
    for word, args in _instructions(dockerfile):
        if word == "FROM":
            parts = args.split()
            name = parts[-1] if len(parts) >= 3 and parts[-2].upper() == "AS" else None
            stages.append({"base": parts[0], "name": name, "body": []})
        elif stages:
            stages[-1]["body"].append((word, args))
    return stages


def test_actionlint():
    bin_dir = built_tool_bin("actionlint", "ACTIONLINT_VERSION")
    if bin_dir is None:
        pytest.skip("actionlint is not built: run `make tools` (e2e/tools/tools.sh actionlint)")
    proc = subprocess.run(
        [str(bin_dir / "actionlint"), "-no-color", str(WORKFLOW)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_nothing_is_published_before_lint_and_the_unit_tests_pass():
    jobs = _workflow()["jobs"]
    commands = [cmd for step in jobs["test"]["steps"] for cmd in _commands(step.get("run", ""))]
    assert ["make", "lint"] in commands
    pytest_runs = [cmd for cmd in commands if "pytest" in cmd]
    assert pytest_runs, f"the release's test job runs no pytest: {commands}"
    assert any("tests/unit" in cmd for cmd in pytest_runs), pytest_runs
    # Every image job waits for the gate; the tag and the chart wait for the images.
    assert "test" in jobs["images"]["needs"]
    assert "images" in jobs["manifest"]["needs"] and "manifest" in jobs["chart"]["needs"]


def test_release_builds_both_dockerfiles_natively_for_two_arches_and_pushes_the_chart():
    wf = _workflow()
    assert wf[True]["push"]["tags"] == ["v*.*.*"]  # YAML 1.1 reads the key `on` as True
    jobs = wf["jobs"]
    matrix = jobs["images"]["strategy"]["matrix"]
    assert matrix["arch"] == ["amd64", "arm64"]
    files = {m["dockerfile"] for m in matrix["include"] if "dockerfile" in m}
    assert files == {"operator/Dockerfile", "init-container/Dockerfile"}
    assert all((REPO / f).is_file() for f in files)
    # Each arch builds on a runner of its own arch: the native stage compiles there, not under QEMU.
    runners = {m["arch"]: m["runner"] for m in matrix["include"] if "runner" in m}
    assert runners == {"amd64": "ubuntu-24.04", "arm64": "ubuntu-24.04-arm"}
    assert jobs["images"]["runs-on"] == "${{ matrix.runner }}"
    assert not any("setup-qemu" in str(s.get("uses", "")) for s in jobs["images"]["steps"])
    build = next(s for s in jobs["images"]["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action"))
    assert build["with"]["platforms"] == "linux/${{ matrix.arch }}"
    assert "push-by-digest=true" in build["with"]["outputs"] and "push=true" in build["with"]["outputs"]
    # The two digests become one multi-arch tag.
    tag = "\n".join(s.get("run", "") for s in jobs["manifest"]["steps"])
    assert "docker buildx imagetools create" in tag and '"$REPO:$VERSION"' in tag
    chart = "\n".join(s.get("run", "") for s in jobs["chart"]["steps"])
    assert "helm package charts/dscache" in chart and 'helm push "dist/dscache-$VERSION.tgz" "oci://' in chart
    # The tag is checked against the one version source before anything is published.
    check = "\n".join(s.get("run", "") for s in jobs["version"]["steps"])
    assert "pyproject.toml" in check and "version" in jobs["test"]["needs"]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version.count(".") == 2


def test_stager_image_compiles_the_native_wheel_and_has_no_fallback():
    text = STAGER_DOCKERFILE.read_text()
    stages = _stages(text)
    assert "build/wheels" not in text, "the image must compile its wheel, not copy one built on the host"
    # A stage on the official Rust image, on the runtime's Debian, compiles native/ with maturin.
    runtime = stages[-1]
    suite = runtime["base"].rsplit(":", 1)[1].split("-")[0]
    native = next(s for s in stages if s["base"].startswith("docker.io/library/rust:"))
    assert native["base"].endswith(f"-slim-{suite}"), (native["base"], runtime["base"])
    assert ("COPY", "native /src/native") in native["body"]
    builds = [args for word, args in native["body"] if word == "RUN" and "maturin build" in args]
    assert len(builds) == 1 and "--release" in builds[0] and "--locked" in builds[0]
    # Compiled crates stay between builds (a warm rebuild compiles nothing it compiled before).
    assert "--mount=type=cache" in builds[0] and "CARGO_TARGET_DIR=" in builds[0]
    # The runtime takes that stage's wheel, installs it from nowhere else, and imports it through
    # the stager's loader in the same RUN, with no branch that could carry on without it.
    assert any(w == "COPY" and a.startswith(f"--from={native['name']} ") for w, a in runtime["body"])
    install = [a for w, a in runtime["body"] if w == "RUN" and "dscache-native" in a]
    assert len(install) == 1, install
    run = install[0]
    assert "--no-index" in run and "import dscache_native" in run and "native.load() is dscache_native" in run
    assert run.index("pip install") < run.index("import dscache_native")
    for fallback in ("||", " if ", " else", "WARNING", "pure-Python"):
        assert fallback not in f" {run} ", f"the wheel's install has a fallback ({fallback.strip()!r}): {run}"


def _key(context: Path, cache: Path) -> str:
    proc = subprocess.run(
        ["bash", str(IMAGES_SH), "key", str(context / "init-container" / "Dockerfile"), str(context)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cache), "DSCACHE_IMAGES_CACHE": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_image_input_key_changes_when_native_changes(tmp_path: Path):
    """images.sh reuses an archive while its key holds: a change in native/ must rebuild the stager."""
    context = tmp_path / "ctx"
    for rel in ("init-container", "node-agent", "contract", "native"):
        shutil.copytree(REPO / rel, context / rel, ignore=shutil.ignore_patterns("__pycache__", "target"))
    cache = tmp_path / "cache"
    before = _key(context, cache)
    assert re.fullmatch(r"[0-9a-f]{16}", before) and _key(context, cache) == before
    lib = context / "native" / "src" / "lib.rs"
    lib.write_text(lib.read_text() + "\n// a change\n")
    assert _key(context, cache) != before

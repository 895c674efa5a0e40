""".github/workflows/release.yml: actionlint-clean, and it publishes what the repository builds."""

from __future__ import annotations

import subprocess
import tomllib

import pytest
import yaml

from tests.support.tools import REPO, built_tool_bin

WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


def test_actionlint():
    bin_dir = built_tool_bin("actionlint", "ACTIONLINT_VERSION")
    if bin_dir is None:
        pytest.skip("actionlint is not built: run `make tools` (e2e/tools/tools.sh actionlint)")
    proc = subprocess.run(
        [str(bin_dir / "actionlint"), "-no-color", str(WORKFLOW)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_release_builds_both_dockerfiles_for_two_arches_and_pushes_the_chart():
    wf = yaml.safe_load(WORKFLOW.read_text())
    assert wf[True]["push"]["tags"] == ["v*.*.*"]  # YAML 1.1 reads the key `on` as True
    jobs = wf["jobs"]
    files = {m["dockerfile"] for m in jobs["images"]["strategy"]["matrix"]["include"]}
    assert files == {"operator/Dockerfile", "init-container/Dockerfile"}
    assert all((REPO / f).is_file() for f in files)
    build = next(s for s in jobs["images"]["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action"))
    assert build["with"]["platforms"] == "linux/amd64,linux/arm64" and build["with"]["push"] is True
    chart = "\n".join(s.get("run", "") for s in jobs["chart"]["steps"])
    assert "helm package charts/dscache" in chart and 'helm push "dist/dscache-$VERSION.tgz" "oci://' in chart
    # The tag is checked against the one version source before anything is published.
    check = "\n".join(s.get("run", "") for s in jobs["version"]["steps"])
    assert "pyproject.toml" in check and jobs["images"]["needs"] == "version"
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert version.count(".") == 2

"""One version source: pyproject.toml's [project] version. Everything that states a version agrees with it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from dscache_operator.metrics.registry import Metrics
from dscache_operator.settings import Settings
from dscache_operator.version import package_version

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_chart_version_and_app_version_are_the_package_version():
    chart = yaml.safe_load((REPO / "charts" / "dscache" / "Chart.yaml").read_text())
    assert (chart["version"], str(chart["appVersion"])) == (VERSION, VERSION), (
        f"charts/dscache/Chart.yaml says version {chart['version']}, appVersion {chart['appVersion']}; "
        f"pyproject.toml says {VERSION}: set both to it (the release workflow does this from the tag)"
    )


def test_operator_reports_the_package_version():
    assert package_version() == VERSION
    m = Metrics()
    (family,) = [f for f in m.registry.collect() if f.name == "dscache_build_info"]
    assert family.samples[0].labels["version"] == VERSION
    assert Settings().stager_image == f"dscache-stager:{VERSION}"


def test_the_lock_pins_the_project_at_the_same_version():
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    (me,) = [p for p in lock["package"] if p["name"] == "dscache"]
    assert me["version"] == VERSION, "uv.lock is stale: run `make lock`"

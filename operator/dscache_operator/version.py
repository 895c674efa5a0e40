"""The one version source: ``[project] version`` in pyproject.toml.

The chart's ``version``/``appVersion`` must equal it (tests/unit/test_version.py),
the operator reports it as ``dscache_build_info{version=...}``, and the default
stager image tag is it.

A source checkout (and the operator image, which copies pyproject.toml next to
the packages) reads pyproject.toml; an installed wheel without it reads the
package metadata, which was built from the same file.
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

PROJECT = "dscache"


@functools.cache
def package_version() -> str:
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "pyproject.toml"
        if candidate.is_file():
            project = tomllib.loads(candidate.read_text()).get("project") or {}
            if project.get("name") == PROJECT and project.get("version"):
                return str(project["version"])
    try:
        return importlib.metadata.version(PROJECT)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

"""Locate (building on first use) the third-party binaries the tests need.

The binaries come from ``e2e/tools/tools.sh``, which builds them through the
Go module proxy into a cache outside the repo, keyed by version.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS_SH = REPO / "e2e" / "tools" / "tools.sh"


@functools.cache
def tool_bin(tool: str) -> Path:
    """Return the bin directory of ``tool`` (see tools.sh for the names)."""
    out = (
        subprocess.run(
            ["bash", str(TOOLS_SH), "--path", tool],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return Path(out)


def kubectl() -> str:
    """kubectl built with the test apiserver (don't rely on the host having one)."""
    return str(tool_bin("kube-apiserver") / "kubectl")

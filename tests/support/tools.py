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


def stop_process(proc: subprocess.Popen | None, timeout: float = 10) -> None:
    """Terminate a server we started, kill it if it lingers, and reap it."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def kubectl() -> str:
    """kubectl built with the test apiserver (don't rely on the host having one)."""
    return str(tool_bin("kube-apiserver") / "kubectl")


def built_tool_bin(tool: str, version_var: str) -> Path | None:
    """The bin dir of ``tool`` if `make tools` has built it, else None (never builds:
    for optional tools whose tests skip, with a message, when they are absent).
    ``version_var``: the tools.sh variable holding its version, e.g. HELM_DOCS_VERSION."""
    import os
    import re

    m = re.search(rf"^{version_var}=(\S+)", TOOLS_SH.read_text(), re.M)
    if not m:
        raise AssertionError(f"{version_var} is not set in {TOOLS_SH}")
    cache = Path(os.environ.get("DSCACHE_TOOLS_DIR") or Path.home() / ".cache" / "dscache" / "tools")
    d = cache / f"{tool}-{m.group(1)}"
    return d / "bin" if (d / ".done").exists() else None

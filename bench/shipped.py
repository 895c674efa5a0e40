"""dscache-stage laid out as the stager image ships it (init-container/Dockerfile), for the benches.

The venv's ``dscache-stage`` is a development install, and two parts of it cost every start
time that no user's stager spends:
- the editable install's finder: site.py imports it at every interpreter start, and it imports
  pathlib, importlib.util and contextlib (about 13 ms of CPU on these machines, of a 1 KiB
  copy's ~100);
- pip's console script, which imports ``re`` to tidy ``sys.argv[0]``.
The image has neither: a venv whose site-packages holds the requirements and the stager's three
packages as plain directories, compiled (compileall), and a three-line ``dscache-stage``. That is
what ``build`` lays out here: a fresh venv from the same interpreter, the dev venv's installed
distributions linked in (the image's are the same pinned versions), our packages copied and
compiled, the image's script. The bench measures what users run; ``--dev-stager`` measures the
venv's instead (bench/stager.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Our packages, copied as the Dockerfile's COPY lines do.
PACKAGES = ("init-container/dscache_stager", "node-agent/dscache_node", "contract/dscache_contract")
#: What the dev venv has that the image does not: the editable install's hooks and metadata.
DEV_ONLY = ("__editable__", "dscache-")
SCRIPT = "#!{python}\nfrom dscache_stager.cli import entry\nentry()\n"


def build(dest: Path) -> Path:
    """Lay the shipped stager out under ``dest`` (a fresh venv); return its ``dscache-stage``."""
    if dest.exists():
        shutil.rmtree(dest)
    base = getattr(sys, "_base_executable", sys.executable)
    # With pip, as the image's venv is made: pip and setuptools bring their own .pth file.
    subprocess.run([base, "-m", "venv", str(dest)], check=True)
    dev = Path(sysconfig.get_paths()["purelib"])
    site = dest / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    for entry in sorted(dev.iterdir()):
        name = entry.name
        if name.endswith(".pth") or name.startswith(DEV_ONLY) or name == "__pycache__" or (site / name).exists():
            continue  # the venv's own pip/setuptools and their .pth stay; no editable hook comes along
        (site / name).symlink_to(entry)
    for package in PACKAGES:
        src = REPO / package
        shutil.copytree(src, site / src.name, ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run([str(dest / "bin" / "python"), "-m", "compileall", "-q", str(site / src.name)], check=True)
    script = dest / "bin" / "dscache-stage"
    script.write_text(SCRIPT.format(python=dest / "bin" / "python3"))
    os.chmod(script, 0o755)
    return script

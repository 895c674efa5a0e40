"""Where each benchmark keeps its final JSON object: bench/results/<name>.json.

Every figure in README.md and docs/*.md is rendered from these files (bench/render.py,
`make docs`), and tests/unit/test_docs_figures_match_results.py fails when a figure and
its file disagree. So a benchmark prints its last JSON line as before, and also hands the
same object to `write`, which stores it beside a few facts about the run (the command, when,
the commit, the cores) that the docs may quote; the object itself is kept as printed.

The name is the benchmark's, with `-quick` for `--quick` runs and an optional variant for a
run of another size (e.g. `operator-10000`), so a quick run never overwrites a full one.
DSCACHE_BENCH_RESULTS names another directory (the integration smoke tests' tiny runs
write there, not over the results the docs quote).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ENV = "DSCACHE_BENCH_RESULTS"


def name(bench: str, *, quick: bool = False, variant: str = "") -> str:
    """The result file's stem: `stager`, `stager-quick`, `operator-10000-quick`, ..."""
    return "-".join(p for p in (bench, variant, "quick" if quick else "") if p)


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def write(bench: str, result: dict[str, Any], *, quick: bool = False, variant: str = "") -> Path:
    """Store `result` (the object the benchmark printed last) as <results dir>/<name>.json."""
    stem = name(bench, quick=quick, variant=variant)
    doc = {
        "run": {
            "command": " ".join(["python", f"bench/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "commit": _commit(),
            "cores": os.cpu_count(),
        },
        "result": result,
    }
    where = Path(os.environ.get(ENV) or RESULTS)
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{stem}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)  # never a half-written result file for the docs to render
    print(f"[results] wrote {path}", file=sys.stderr, flush=True)
    return path

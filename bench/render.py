"""Render the benchmark figures in README.md and docs/*.md from bench/results/*.json.

A figure in the docs is written between two markers that name where it comes from:

    <!-- fig stager-quick.small_s.dscache .2f -->2.56<!-- /fig --> s

- `stager-quick` is the result file (bench/results/stager-quick.json, written by the
  benchmark itself through bench/results.py); the dotted rest is the path to a field of
  the object the benchmark printed last (list items by index). `stager-quick@date` reads
  the run's own facts instead (`command`, `date`, `commit`, `cores`).
- `A / B` (spaces around the operator) is the ratio of two such fields (e.g. s5cmd's seconds over dscache's), `A - B`
  their difference, `A * N` a field times a number (e.g. a fraction as a percentage).
- The optional last word is a Python format spec (`.2f`, `,.0f`, `.0%`, `,`); without one
  the value is written as it is in the file.

`python bench/render.py` rewrites the text between the markers (`make docs`);
`--check` only reports figures that differ, and exits 1. The unit test
tests/unit/test_docs_figures_match_results.py runs the same check, so a figure edited by
hand, a result file re-run without `make docs`, or a marker naming a field that is not
there fails the suite.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

MARKER = re.compile(r"<!-- fig (?P<spec>[^>]*?) -->(?P<text>.*?)<!-- /fig -->", re.S)
_REF = r"[A-Za-z0-9_-]+(?:@[A-Za-z_]+|(?:\.[A-Za-z0-9_-]+)+)"
# An operator stands between spaces: keys may hold a dash (`dd-fdatasync`).
_SPEC = re.compile(
    rf"^(?P<a>{_REF})(?:\s+(?P<op>[/*-])\s+(?P<b>{_REF}|[0-9.]+))?(?:\s+(?P<fmt>\S+))?$",
)


class FigureError(Exception):
    """A marker that cannot be rendered: a malformed spec, a missing file or field."""


def docs(repo: Path = REPO) -> list[Path]:
    """Every document that may carry figures."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


@dataclass
class Results:
    """The result files, each read once."""

    root: Path = RESULTS

    def __post_init__(self) -> None:
        self._files: dict[str, dict[str, Any]] = {}

    def file(self, stem: str) -> dict[str, Any]:
        if stem not in self._files:
            path = self.root / f"{stem}.json"
            if not path.is_file():
                raise FigureError(f"no result file {path.name} in {self.root}")
            self._files[stem] = json.loads(path.read_text())
        return self._files[stem]

    def ref(self, ref: str) -> Any:
        """The value a reference names: `file.path.to.field` or `file@fact`."""
        if "@" in ref:
            stem, fact = ref.split("@", 1)
            run = self.file(stem).get("run", {})
            if fact not in run:
                raise FigureError(f"{ref}: the run of {stem}.json has no {fact!r}")
            return run[fact]
        stem, *path = ref.split(".")
        value: Any = self.file(stem).get("result")
        for i, key in enumerate(path):
            where = ".".join([stem, *path[:i]])
            if isinstance(value, dict) and key in value:
                value = value[key]
            elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
                value = value[int(key)]
            else:
                raise FigureError(f"{ref}: {where} has no field {key!r}")
        return value

    def figure(self, spec: str) -> str:
        """The text a marker's spec renders to."""
        m = _SPEC.match(spec.strip())
        if not m:
            raise FigureError(f"malformed figure spec {spec!r}")
        value = self.ref(m["a"])
        if m["op"]:
            other = float(m["b"]) if re.fullmatch(r"[0-9.]+", m["b"]) else self.ref(m["b"])
            if not all(isinstance(v, int | float) for v in (value, other)):
                raise FigureError(f"{spec!r}: {m['op']} needs two numbers, got {value!r} and {other!r}")
            if m["op"] == "/":
                if other == 0:
                    raise FigureError(f"{spec!r}: division by zero")
                value = value / other
            elif m["op"] == "*":
                value = value * other
            else:
                value = value - other
        if isinstance(value, dict | list) or value is None:
            raise FigureError(f"{spec!r} names {type(value).__name__}, not a figure")
        try:
            return format(value, m["fmt"] or "")
        except (ValueError, TypeError) as e:
            raise FigureError(f"{spec!r}: cannot format {value!r} with {m['fmt']!r}: {e}") from e


@dataclass
class Mismatch:
    doc: str
    spec: str
    written: str
    expected: str  # or the error, when the figure cannot be rendered

    def __str__(self) -> str:
        return f"{self.doc}: <!-- fig {self.spec} --> says {self.written!r}, its result file says {self.expected!r}"


def render(text: str, results: Results) -> str:
    """The document with every figure rewritten from the result files (FigureError if one cannot be)."""
    return MARKER.sub(lambda m: f"<!-- fig {m['spec']} -->{results.figure(m['spec'])}<!-- /fig -->", text)


def check(text: str, results: Results, doc: str = "") -> tuple[int, list[Mismatch]]:
    """How many figures the document has, and those that differ from (or are missing in) the results."""
    found, bad = 0, []
    for m in MARKER.finditer(text):
        found += 1
        try:
            expected = results.figure(m["spec"])
        except FigureError as e:
            bad.append(Mismatch(doc, m["spec"], m["text"], f"error: {e}"))
            continue
        if m["text"] != expected:
            bad.append(Mismatch(doc, m["spec"], m["text"], expected))
    return found, bad


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a figure differs")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(list(argv) if argv is not None else None)
    results = Results(args.results)
    total, failed = 0, False
    for path in docs():
        text = path.read_text()
        found, bad = check(text, results, str(path.relative_to(REPO)))
        total += found
        if args.check:
            for b in bad:
                print(b, file=sys.stderr)
            failed |= bool(bad)
            continue
        try:
            new = render(text, results)
        except FigureError as e:
            print(f"{path.relative_to(REPO)}: {e}", file=sys.stderr)
            failed = True
            continue
        if new != text:
            path.write_text(new)
            print(f"rendered {path.relative_to(REPO)} ({len(bad)} of {found} figures changed)")
    print(f"{total} figures in {len(docs())} documents" + (": some differ" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every benchmark figure in README.md and docs/*.md is the one its result file holds.

The figures are written between `<!-- fig FILE.path spec -->` markers and rendered from
bench/results/*.json (bench/render.py, `make docs`); the result files are written by the
benchmarks themselves (bench/results.py). A figure edited by hand, a benchmark re-run
without `make docs`, or a marker naming a field its file does not have fails here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


render = _load("render")
results_mod = _load("results")


def test_docs_figures_match_results():
    results = render.Results()
    total, bad = 0, []
    for path in render.docs(REPO):
        found, mismatches = render.check(path.read_text(), results, str(path.relative_to(REPO)))
        total += found
        bad += mismatches
    assert [str(b) for b in bad] == [], "run `make docs` (bench/render.py) after a benchmark, never edit a figure"
    # The docs quote the benchmarks through markers: none at all means the markers were lost.
    assert total >= 20, f"only {total} rendered figures in the docs"


def test_every_result_file_is_a_benchmarks_own():
    """Each file holds what bench/results.py wrote: the run's facts and the printed object."""
    files = sorted((REPO / "bench" / "results").glob("*.json"))
    assert files, "no result files in bench/results"
    for path in files:
        doc = json.loads(path.read_text())
        assert set(doc) == {"run", "result"}, path.name
        assert doc["run"]["command"].startswith("python bench/"), path.name
        bench = doc["run"]["command"].split()[1].removeprefix("bench/").removesuffix(".py")
        assert path.stem.startswith(bench), f"{path.name} was written by bench/{bench}.py"
        assert ("--quick" in doc["run"]["command"].split()) == path.stem.endswith("-quick"), path.name
        assert isinstance(doc["result"], dict) and doc["result"], path.name


# The mechanism itself, on result files of its own: each way a figure can go wrong is caught.


@pytest.fixture
def results(tmp_path: Path):
    (tmp_path / "stager-quick.json").write_text(
        json.dumps(
            {
                "run": {"command": "python bench/stager.py --quick", "date": "2026-11-26"},
                "result": {"small_s": {"dscache": 2.5, "s5cmd": 4.0}, "runs": [{"cpu": 0.25}], "objects": 5000},
            }
        )
    )
    return render.Results(tmp_path)


def test_a_rendered_figure_matches(results):
    text = (
        "<!-- fig stager-quick.small_s.s5cmd / stager-quick.small_s.dscache .2f -->?<!-- /fig -->x, "
        "<!-- fig stager-quick.objects , -->?<!-- /fig --> objects, "
        "<!-- fig stager-quick.runs.0.cpu * 100 .0f -->?<!-- /fig -->%, "
        "<!-- fig stager-quick.small_s.s5cmd - stager-quick.small_s.dscache -->?<!-- /fig --> s, "
        "on <!-- fig stager-quick@date -->?<!-- /fig -->"
    )
    out = render.render(text, results)
    assert "-->1.60<!--" in out and "-->5,000<!--" in out and "-->25<!--" in out and "-->1.5<!--" in out
    assert "-->2026-11-26<!--" in out
    assert render.check(out, results) == (5, [])


def test_a_figure_edited_by_hand_fails(results):
    text = "<!-- fig stager-quick.small_s.dscache .2f -->2.40<!-- /fig -->"
    found, bad = render.check(text, results, "doc.md")
    assert found == 1 and [(b.written, b.expected) for b in bad] == [("2.40", "2.50")]


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("stager-quick.small_s.rclone", "has no field 'rclone'"),
        ("stager-quick.runs.3.cpu", "has no field '3'"),
        ("stager-quick@load", "has no 'load'"),
        ("operator-quick.converged", "no result file operator-quick.json"),
        ("stager-quick.small_s", "not a figure"),
        ("stager-quick.small_s.dscache .2q", "cannot format"),
        ("not a spec at all!", "malformed"),
    ],
)
def test_a_marker_naming_what_is_not_there_fails(results, spec, error):
    found, bad = render.check(f"<!-- fig {spec} -->1<!-- /fig -->", results)
    assert found == 1 and len(bad) == 1 and error in bad[0].expected
    with pytest.raises(render.FigureError, match=error.split("'")[0].strip()):
        render.render(f"<!-- fig {spec} -->1<!-- /fig -->", results)


def test_results_write_keeps_the_printed_object(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(results_mod, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(sys, "argv", ["bench/operator.py", "--quick", "--caches", "10000"])
    printed = {"converged": True, "operator_rss_mib": 112.0}
    path = results_mod.write("operator", printed, quick=True, variant="10000")
    assert path.name == "operator-10000-quick.json"
    doc = json.loads(path.read_text())
    assert doc["result"] == printed
    assert doc["run"]["command"] == "python bench/operator.py --quick --caches 10000"
    assert results_mod.name("stager") == "stager" and results_mod.name("fanout", quick=True) == "fanout-quick"


def test_results_write_goes_where_the_environment_says(tmp_path: Path, monkeypatch):
    """The smoke tests' tiny runs set DSCACHE_BENCH_RESULTS, so they never overwrite bench/results/."""
    monkeypatch.setattr(results_mod, "RESULTS", tmp_path / "never")
    monkeypatch.setenv(results_mod.ENV, str(tmp_path / "elsewhere"))
    monkeypatch.setattr(sys, "argv", ["bench/stager.py"])
    assert results_mod.write("stager", {"x": 1}) == tmp_path / "elsewhere" / "stager.json"
    assert not (tmp_path / "never").exists()

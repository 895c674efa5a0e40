"""DSCACHE_TRACE (dscache_stager/trace.py): a cold copy's timeline on stderr, silent when off."""

from __future__ import annotations

import pytest

from dscache_stager import trace


def test_a_mark_is_one_line_of_clock_event_and_count_when_tracing_is_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(trace, "ON", True)
    trace.mark("batch-go", 64)
    trace.mark("done")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[0] for line in lines] == ["dscache-trace", "dscache-trace"]
    assert [line.split()[2:] for line in lines] == [["batch-go", "64"], ["done", "0"]]
    first, second = (float(line.split()[1]) for line in lines)
    assert 0 < first <= second  # CLOCK_MONOTONIC seconds, in order


def test_nothing_is_written_when_tracing_is_off(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(trace, "ON", False)
    trace.mark("page", 1000)
    assert capsys.readouterr().err == ""

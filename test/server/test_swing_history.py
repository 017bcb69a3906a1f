"""benchmark/swing_history.py: issue 13's swing line pooled over the runs recorded in the docs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import swing_history  # noqa: E402


def _table(swings: dict[tuple[str, int], str]) -> list[str]:
    head = ["| model | sessions | ours | vLLM bind 0-1 | swing ours / vLLM bind (default) |"]
    rows = [f"| {m} | {n} | 1 / 2 / 3 | 4 / 5 / 6 | {s} |" for (m, n), s in swings.items()]
    return [*head, "|---|---|---|---|---|", *rows, ""]


def test_a_run_is_a_full_table_under_a_session_heading() -> None:
    full = {cell: f"**{10 * i + 5} / 1,{i}00** (7)" for i, cell in enumerate(swing_history.CELLS)}
    full[("tiny", 4)] = "73 / 58 (123)"  # a miss: not bold
    second = {cell: f"{i} / {i}" for i, cell in enumerate(swing_history.CELLS)}  # no default
    doc = [
        "### Latest run (session 43)",
        *_table(full),
        "text between two runs of one session",
        *_table(second),
        "### Session 38, small 16 re-run",
        *_table({("small", 16): "**25 / 40** (46)"}),  # one cell: not a full run
        "### Earlier runs",  # no session number: its tables are not runs
        *_table(full),
    ]
    runs = swing_history.parse(doc)
    assert [r.session for r in runs] == [43, 43]
    assert runs[0].cells[("tiny", 1)] == swing_history.Swing(5, 1000, True)
    assert runs[0].cells[("tiny", 4)] == swing_history.Swing(73, 58, False)
    assert runs[1].cells[("small", 16)] == swing_history.Swing(5, 5, False)
    lines = swing_history.report(runs)
    assert lines[0] == "2 full runs, sessions 43, 43"
    assert "| tiny | 4 | 0 of 2 | 37 / 29.5 | 74 / 59 |" in lines
    assert lines[-1].endswith("never")  # a cell never met


def test_the_docs_record_the_runs_the_pooled_figures_come_from() -> None:
    """docs/performance.md quotes the pooled tallies; they must stay computable from the docs."""
    since = swing_history.recorded_runs(32)
    assert len(since) >= 10
    assert all(len(r.cells) == len(swing_history.CELLS) for r in since)

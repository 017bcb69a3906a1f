"""benchmark/screen_sim.py scores a screen by the same rule as bench_sim.py's summary."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import bench_sim  # noqa: E402
import screen_sim  # noqa: E402

RESULTS = ROOT / "docs/results.md"


def _summary() -> dict[tuple[str, str, int], float]:
    """The margin column of results.md's summary table (written by bench_sim.py)."""
    out = {}
    for line in RESULTS.read_text().splitlines():
        m = re.match(r"\| (\S+) \| (\S+) \| ([\d.]+) GB \| [\d.]+ \| ([+-][\d.]+) \|", line)
        if m:
            out[(m[1], m[2], round(float(m[3]) * 1e9))] = float(m[4])
    return out


def test_reads_every_cell_of_results() -> None:
    cells = screen_sim.read_results(RESULTS)
    n = len(bench_sim.TRACES) * len(bench_sim.MODELS) * len(bench_sim.FRACTIONS)
    assert len(cells) == n
    assert set(cells) == set(_summary())
    for cols in cells.values():
        assert {"sglang+", "vllm-0.32", "marconi", "marconi best fixed alpha"} <= set(cols)
        assert all(0.0 <= v <= 100.0 for v in cols.values())


def test_margins_match_bench_sim_summary() -> None:
    """Fed results.md's own marconi and best-fixed columns, the screen reproduces the summary's
    margins (to the tables' rounding) and flags exactly the cells below -0.2 or, on Mooncake,
    below vllm-0.32."""
    cells = screen_sim.read_results(RESULTS)
    rows = []
    for (t, m, cap), cols in cells.items():
        rows.append((t, m, cap, "auto", cols["marconi"]))
        rows.append((t, m, cap, "0", cols["marconi best fixed alpha"]))
    lines = screen_sim.report(rows, RESULTS)
    summary = _summary()
    expected_met = 0
    for line in lines[2:-2]:
        t, m, cap, _, _, _, margin, _ = (c.strip() for c in line.strip("|").split("|"))
        key = (t, m, round(float(cap.split()[0]) * 1e9))
        assert abs(float(margin.split()[0]) - summary[key]) <= 0.011, line
        ok = summary[key] >= -0.2 and (
            t != "mooncake" or cells[key]["marconi"] >= cells[key]["vllm-0.32"]
        )
        assert ("MISS" not in margin) == ok, line
        expected_met += ok
    assert lines[-1] == f"target met in {expected_met} of {len(cells)} cells"

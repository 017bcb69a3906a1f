"""benchmark/vs_vllm_table.py scores issue 13's lines as docs/performance.md states them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import vs_vllm_table  # noqa: E402


def _result(p50: float, p95: float, itl: float) -> dict:
    return {"ttft_ms": {"p50": p50, "p95": p95}, "itl_ms": {"p50": itl}}


def test_each_line_against_the_better_binding(tmp_path: Path) -> None:
    """TTFT and ITL against the best of vLLM's two bindings, each on its own; the swing against
    the binding with the lower TTFT P95 (here `vllm-bind`, although `vllm` swings less)."""
    data = {
        "args": {"server_args": "--model small --cache-memory 1GiB"},
        "results": {
            "marconi @4": _result(500, 1200, 50),
            "vllm @4": _result(450, 2800, 67),
            "vllm-bind @4": _result(780, 1900, 49),
            "marconi @16": _result(1100, 3000, 75),
            "vllm @16": _result(3900, 6500, 115),
            "vllm-bind @16": _result(2300, 3900, 80),
        },
        "p95_by_round": {
            "marconi @4": [1000, 1300],
            "vllm @4": [2800, 2850],
            "vllm-bind @4": [1800, 2050],
            "marconi @16": [2600, 3000],
            "vllm @16": [5800, 6800],
            "vllm-bind @16": [3300, 3900],
        },
    }
    path = tmp_path / "serving_small.json"
    path.write_text(json.dumps(data))
    lines = vs_vllm_table.report([path])
    row4 = next(line for line in lines if line.startswith("| small | marconi | 4 |"))
    cols = [c.strip() for c in row4.strip("|").split("|")]
    assert cols[3:8] == [
        "500 vs 450 MISS", "1200 vs 1900", "50 vs 49 MISS", "300 vs 250 MISS", "vllm-bind"
    ]  # fmt: skip
    row16 = next(line for line in lines if line.startswith("| small | marconi | 16 |"))
    assert "MISS" not in row16 and "400 vs 600" in row16
    assert lines[-1] == "met: TTFT P50 1/2, TTFT P95 2/2, ITL P50 1/2, swing 1/2"

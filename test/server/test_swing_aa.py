"""benchmark/swing_aa.py: A/A runs start one server twice and score the two copies' swings;
benchmark/servers.py: what bench_serving.py reads of our server per round."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from marconi.launch_server import ServerHandle

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark"))

import servers  # noqa: E402
import swing_aa  # noqa: E402


def test_a_label_starts_the_same_server() -> None:
    """``NAME#label`` runs exactly NAME's command line and environment; the label only names it."""
    args = "--model tiny --cache-memory 1GiB"
    for name in ("marconi", "marconi/burst-wait-ms=4/OMP_WAIT_POLICY=PASSIVE"):
        assert servers.command(f"{name}#2", 1234, args) == servers.command(name, 1234, args)
    assert servers.base_name("vllm-bind#b") == "vllm-bind"


def _aa_json(path: Path, model: str, rounds: dict[int, tuple[list[float], list[float]]]) -> None:
    p95 = {}
    for level, (first, second) in rounds.items():
        p95[f"marconi @{level}"], p95[f"marconi#2 @{level}"] = first, second
    data = {"args": {"server_args": f"--model {model} --cache-memory 1GiB"}, "p95_by_round": p95}
    path.write_text(json.dumps(data))


def test_report_counts_each_cell_over_the_runs(tmp_path: Path) -> None:
    _aa_json(
        tmp_path / "a.json", "small", {16: ([1000, 1200], [900, 1000]), 4: ([50, 60], [50, 80])}
    )
    _aa_json(tmp_path / "b.json", "small", {16: ([1000, 1050], [900, 1050])})
    lines = swing_aa.report(sorted(tmp_path.glob("*.json")))
    assert lines[2] == "| small | 4 | 10 / 30 | 1 of 1 | 3.00 |"
    # swings 200 / 100 (copy 1 wider: 2.0) and 50 / 150 (copy 2 wider: 3.0); median 2.5
    assert lines[3] == "| small | 16 | 200 / 100, 50 / 150 | 1 of 2 | 2.50 |"


def test_cells_are_checked() -> None:
    assert swing_aa.parse_cells("tiny:4,small:16,tiny:16") == {"tiny": [4, 16], "small": [16]}
    with pytest.raises(SystemExit):
        swing_aa.parse_cells("huge:4")


def test_engine_seconds_reads_our_servers_step_phases(marconi_server: ServerHandle) -> None:
    """What ``bench_serving.py`` records per round: the engine's seconds by step phase, read
    from the real server's ``/metrics``, growing with the work; nothing from a server without
    the metric."""
    url = marconi_server.url
    before = servers.engine_seconds(url)
    assert set(before) == {"schedule", "forward", "sample", "postprocess"}
    body = {"model": "tiny", "prompt": "Count the steps", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    after = servers.engine_seconds(url)
    assert all(after[k] > before[k] for k in ("forward", "sample", "postprocess")), after
    assert servers.engine_seconds(f"{url}/no-such-server") == {}

"""Issue 13's targets, cell by cell, from the JSON files of a `vs_vllm.sh` run.

    .venv/bin/python benchmark/vs_vllm_table.py results/vs_vllm/serving_tiny.json ...

For each of our servers, model and concurrency: TTFT P50 / P95 and ITL P50 (pooled over the
rounds) against the better of vLLM's two bindings on each, and our per-round TTFT P95 swing
(max - min over the rounds) against that of vLLM's better binding (the one with the lower TTFT
P95), the table docs/performance.md keeps. A cell meets a line when ours is at or below vLLM's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from servers import VLLM_NAMES

LINES = ("TTFT P50", "TTFT P95", "ITL P50", "swing")


def _metrics(result: dict, rounds: list[float]) -> tuple[float, float, float, float]:
    swing = max(rounds) - min(rounds) if rounds else float("nan")
    return result["ttft_ms"]["p50"], result["ttft_ms"]["p95"], result["itl_ms"]["p50"], swing


def cells(path: Path) -> list[tuple[str, str, int, tuple, tuple, str]]:
    """(model, our server, sessions, our metrics, vLLM's best metrics, vLLM's better binding)
    per cell of one serving JSON (``bench_serving.py --json``)."""
    data = json.loads(path.read_text())
    model = re.search(r"--model (\S+)", data["args"].get("server_args") or "")
    by: dict[int, dict[str, tuple]] = {}
    for key, result in data["results"].items():
        name, level = key.rsplit(" @", 1)
        by.setdefault(int(level), {})[name] = _metrics(result, data["p95_by_round"].get(key, []))
    out = []
    for level, runs in sorted(by.items()):
        peers = {n: m for n, m in runs.items() if n in VLLM_NAMES}
        if not peers:
            continue
        better = min(peers, key=lambda n: peers[n][1])
        best = (*(min(m[i] for m in peers.values()) for i in range(3)), peers[better][3])
        for name, m in runs.items():
            if name not in VLLM_NAMES:
                out.append((model.group(1) if model else path.stem, name, level, m, best, better))
    return out


def report(paths: Sequence[Path]) -> list[str]:
    """One row per cell (ours vs vLLM's, "MISS" where ours is above) and the count met."""
    head = ("model", "ours", "sessions", *LINES[:3], "P95 swing", "vLLM's better binding")
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    met = dict.fromkeys(LINES, 0)
    n = 0
    for path in paths:
        for model, name, level, ours, best, better in cells(path):
            n += 1
            cols = []
            for line, a, b in zip(LINES, ours, best, strict=True):
                ok = a <= b
                met[line] += ok
                cols.append(f"{a:.0f} vs {b:.0f}{'' if ok else ' MISS'}")
            lines.append(f"| {model} | {name} | {level} | " + " | ".join(cols) + f" | {better} |")
    lines += ["", "met: " + ", ".join(f"{k} {v}/{n}" for k, v in met.items())]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", type=Path, help="bench_serving.py --json files")
    print("\n".join(report(ap.parse_args(argv).json)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

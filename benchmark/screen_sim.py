"""Screen `marconi` as the code stands on `make bench-sim`'s 30 cells in about a minute (issue 10).

    .venv/bin/python benchmark/screen_sim.py [--alphas 0,0.5,1] [--json F] [--workers 2]

Runs ours tuned and at each fixed alpha on bench_sim.py's traces, models and capacities (nothing
else: the peer columns are read from docs/results.md, which `make bench-sim` wrote with the same
traces and capacities) and prints, per cell, ours, the best fixed alpha, the best peer, the
margin and the sglang+ -> oracle gap closed, then how many cells meet issue 10's target: ours >=
max(every peer, both best fixed alphas) - 0.2 point, and on Mooncake >= vllm-0.32. Edit the
policy, run this, and compare; a variant worth keeping then gets a full `make bench-sim`.
Cells run in ``--workers`` processes (one per core by default): say what else was running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bench_sim import MODELS, OURS, TRACES, _load, capacities
from marconi.cache.cost import load_cost_model
from marconi.sim.simulate import SimSpec, infinite_cache, simulate

ROOT = Path(__file__).resolve().parent.parent
MARGIN = 0.2  # points: issue 10's tolerance against the best other column
OWN = ("marconi", "marconi best fixed alpha", "oracle", "infinite")  # not a peer column


def read_results(path: Path) -> dict[tuple[str, str, int], dict[str, float]]:
    """Every cell's columns (hit rate in %) from a docs/results.md written by bench_sim.py,
    keyed by (trace, model, capacity in bytes)."""
    cells: dict[tuple[str, str, int], dict[str, float]] = {}
    trace = model = None
    cols: list[str] = []
    for line in path.read_text().splitlines():
        if m := re.match(r"### (\S+) \(.*— (\S+)$", line):
            trace, model = m.groups()
        elif line.startswith("| capacity"):
            cols = [c.strip() for c in line.strip("|").split("|")]
        elif trace and re.match(r"\| [\d.]+ GB \|", line):
            row = dict(zip(cols, (c.strip() for c in line.strip("|").split("|")), strict=True))
            cap = round(float(row.pop("capacity").split()[0]) * 1e9)
            row.pop("alpha", None)
            cells[(trace, model, cap)] = {k: float(v) for k, v in row.items() if v != "n/a"}
    return cells


def _cells(job: tuple[str, str, Sequence[str]]) -> list[tuple[str, str, int, str, float]]:
    """The rows of one trace and model: its three capacities, each alpha."""
    tname, mname, alphas = job
    trace, cost = _load(tname, dict(TRACES[tname])), load_cost_model(mname)
    out = []
    for cap in capacities(trace, cost, infinite_cache(trace, cost)):
        for a in alphas:
            spec = SimSpec(OURS, cap, alpha=a if a == "auto" else float(a), trace_name=tname)
            out.append((tname, mname, cap, a, 100 * simulate(trace, cost, spec).token_hit_rate))
    return out


def screen(alphas: Sequence[str], workers: int) -> list[tuple[str, str, int, str, float]]:
    """(trace, model, capacity, alpha, hit %) for ours tuned ("auto") and at each alpha."""
    jobs = [(t, m, ["auto", *alphas]) for t in TRACES for m in MODELS]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return [row for rows in pool.map(_cells, jobs) for row in rows]


def report(rows: Sequence[tuple[str, str, int, str, float]], results: Path) -> list[str]:
    """One line per cell and the count of cells that meet the target."""
    peers = read_results(results)
    by: dict[tuple[str, str, int], dict[str, float]] = {}
    for t, m, cap, a, hit in rows:
        by.setdefault((t, m, cap), {})[a] = hit
    lines = [
        "| trace | model | capacity | ours | best fixed | best peer | margin | gap closed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    met = 0
    for (t, m, cap), hits in by.items():
        cols = peers.get((t, m, cap))
        if cols is None:
            raise SystemExit(f"{results} has no cell {t} {m} {cap / 1e9:g} GB: run make bench-sim")
        ours = hits["auto"]
        fixed = max((v for a, v in hits.items() if a != "auto"), default=ours)
        peer = max(v for k, v in cols.items() if k not in OWN)
        margin = ours - max(peer, fixed)
        ok = margin >= -MARGIN and (t != "mooncake" or ours >= cols["vllm-0.32"])
        met += ok
        lo, hi = cols["sglang+"], cols.get("oracle", 0.0)
        gap = f"{(ours - lo) / (hi - lo):.2f}" if hi > lo else "n/a"
        lines.append(
            f"| {t} | {m} | {cap / 1e9:g} GB | {ours:.2f} | {fixed:.2f} | {peer:.2f} |"
            f" {margin:+.2f}{'' if ok else ' MISS'} | {gap} |"
        )
    return [*lines, "", f"target met in {met} of {len(by)} cells"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", default="0,0.5,1", help="fixed alphas to compare with")
    ap.add_argument("--results", type=Path, default=ROOT / "docs/results.md")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, help="also write the raw rows here")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    rows = screen([a for a in args.alphas.split(",") if a], args.workers)
    print("\n".join(report(rows, args.results)))
    print(f"({time.perf_counter() - t:.0f} s, {args.workers} processes)")
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Screen `marconi` as the code stands on `make bench-sim`'s 30 cells in about a minute (issue 10).

    .venv/bin/python benchmark/screen_sim.py [--alphas 0,0.5,1] [--json F] [--workers 2]

Runs ours tuned and at each fixed alpha on bench_sim.py's traces, models and capacities (nothing
else: the peer columns are read from docs/results.md, which `make bench-sim` wrote with the same
traces and capacities) and prints, per cell, ours, the best fixed alpha, the best peer, the
margin and the sglang+ -> oracle gap closed, then how many cells meet issue 10's target: ours >=
max(every peer, both best fixed alphas) - 0.2 point, and on Mooncake >= vllm-0.32. Edit the
policy, run this, and compare; a variant worth keeping then gets a full `make bench-sim`.
Cells run in ``--workers`` processes (one per core by default): say what else was running.

``--robust`` screens other sizes of the same traces instead (``ROBUST``: ShareGPT 250 / 350
sessions, SWE 34 / 50, Mooncake 2,600 / 3,400 requests, ..., at the bench's high and moderate
contention), where results.md has no peer columns: it scores ours tuned and each fixed alpha
against the best fixed alpha of the same run (and vllm-0.32 on Mooncake, replayed here), so
a variant that wins the 30 cells by fitting them shows up as a loss here (about 2 minutes).
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
#: other sizes of the bench traces (loader arguments), for ``--robust``
ROBUST = {
    "sharegpt": [{"num_sessions": 250}, {"num_sessions": 350}],
    "swe": [{"num_sessions": 34}, {"num_sessions": 50}],
    "mooncake": [{"limit": 2600}, {"limit": 3400}],
    "sharegpt+reasoning": [{"num_sessions": 250}],
    "swe+retokenized": [{"num_sessions": 34}, {"num_sessions": 50}],
}


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


Row = tuple[str, str, int, str, float]  # trace, model, capacity, alpha (or a peer), hit %


def _cells(job: tuple[str, dict, str, Sequence[str], int]) -> list[Row]:
    """The rows of one trace and model: its first ``ncap`` capacities, each alpha ("vllm-0.32"
    replays that peer instead)."""
    tname, kw, mname, alphas, ncap = job
    trace, cost = _load(tname, dict(kw)), load_cost_model(mname)
    label = tname + "".join(f" {v}" for v in kw.values()) if kw != TRACES.get(tname) else tname
    out = []
    for cap in capacities(trace, cost, infinite_cache(trace, cost))[:ncap]:
        for a in alphas:
            if a == "vllm-0.32":
                spec = SimSpec(a, cap, trace_name=tname)
            else:
                spec = SimSpec(OURS, cap, alpha=a if a == "auto" else float(a), trace_name=tname)
            out.append((label, mname, cap, a, 100 * simulate(trace, cost, spec).token_hit_rate))
    return out


def screen(alphas: Sequence[str], workers: int, robust: bool = False) -> list[Row]:
    """(trace, model, capacity, alpha, hit %) for ours tuned ("auto") and at each alpha: on
    the bench's cells, or (``robust``) on ``ROBUST``'s at the two higher contentions."""
    if robust:
        jobs = [(t, kw, m, ["auto", *alphas] + ["vllm-0.32"] * (t == "mooncake"), 2)
                for t, kws in ROBUST.items() for kw in kws for m in MODELS]  # fmt: skip
    else:
        jobs = [(t, TRACES[t], m, ["auto", *alphas], 3) for t in TRACES for m in MODELS]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return [row for rows in pool.map(_cells, jobs) for row in rows]


def report_robust(rows: Sequence[Row], alphas: Sequence[str]) -> list[str]:
    """One line per cell, then per choice (tuned or a fixed alpha): the cells within ``MARGIN``
    of the best fixed alpha (and at least vllm-0.32 on Mooncake), and the summed shortfall."""
    by: dict[tuple[str, str, int], dict[str, float]] = {}
    for t, m, cap, a, hit in rows:
        by.setdefault((t, m, cap), {})[a] = hit
    cols = ["auto", *alphas]
    lines = [
        "| trace | model | capacity | " + " | ".join(cols) + " | vllm-0.32 |",
        "|---|---|---|" + "---|" * (len(cols) + 1),
    ]
    score = {c: [0, 0.0] for c in cols}
    for (t, m, cap), hits in by.items():
        best = max(hits[a] for a in alphas)
        peer = hits.get("vllm-0.32")
        for c in cols:
            short = max(0.0, best - MARGIN - hits[c], 0.0 if peer is None else peer - hits[c])
            score[c][0] += short == 0.0
            score[c][1] += short
        vals = " | ".join(f"{hits[c]:.2f}" for c in [*cols, "vllm-0.32"] if c in hits)
        lines.append(f"| {t} | {m} | {cap / 1e9:g} GB | {vals} |" + " |" * (peer is None))
    lines.append("")
    for c in cols:
        lines.append(f"{c}: met in {score[c][0]} of {len(by)} cells, shortfall {score[c][1]:.2f}")
    return lines


def report(rows: Sequence[Row], results: Path) -> list[str]:
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
    ap.add_argument("--robust", action="store_true", help="other trace sizes (ROBUST)")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    alphas = [a for a in args.alphas.split(",") if a]
    rows = screen(alphas, args.workers, args.robust)
    print("\n".join(report_robust(rows, alphas) if args.robust else report(rows, args.results)))
    print(f"({time.perf_counter() - t:.0f} s, {args.workers} processes)")
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

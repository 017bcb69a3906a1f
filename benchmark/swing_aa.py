"""How much of issue 13's swing line is the benchmark's own noise: A/A runs.

The swing line compares our per-round TTFT P95 swing (max - min over a run's rounds) with
vLLM's. This starts the *same* server twice under two names (``NAME`` and ``NAME#2``,
``servers.py``), replays ``vs_vllm.sh``'s workload on both in interleaved rounds, ``--repeats``
times, and prints each run's two swings; per cell, how often the first copy's swing was at or
below the second's (identical servers: about half the time) and the median ratio of the wider
swing to the narrower one. Run it for ours and for vLLM to see how far two copies of one server
disagree on the line, with nothing else running::

    .venv/bin/python benchmark/swing_aa.py --server marconi --cells tiny:4,small:16 --repeats 4
    .venv/bin/python benchmark/swing_aa.py --server vllm-bind --cells tiny:4,small:16

``--no-run`` tabulates the JSON files already in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from servers import model_option

HERE = Path(__file__).resolve().parent
MODELS = ("tiny", "small")  # vs_vllm.sh's; it sets the sessions replayed per model


def parse_cells(spec: str) -> dict[str, list[int]]:
    """``tiny:4,small:16`` -> {model: [sessions in flight, ...]}."""
    cells: dict[str, list[int]] = {}
    for item in spec.split(","):
        model, _, level = item.partition(":")
        if model not in MODELS or not level.isdigit():
            raise SystemExit(f"bad cell {item!r}: MODEL:SESSIONS with MODEL in {MODELS}")
        cells.setdefault(model, []).append(int(level))
    return cells


def run_one(server: str, model: str, levels: list[int], rounds: int, out: Path) -> None:
    """One A/A replay of ``model`` at ``levels``: vs_vllm.sh's serving replay (its workload, one
    definition) of ``server`` and ``server#2`` only; its JSON is moved to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ, "PY": sys.executable, "MODELS": model, "SERVERS": f"{server},{server}#2",
            "CONCURRENCY": ",".join(map(str, levels)), "ROUNDS": str(rounds), "OUT": tmp,
            "SERVING_ONLY": "1",
        }  # fmt: skip
        script = str(HERE / "vs_vllm.sh")
        subprocess.run(["bash", script], env=env, check=True, stdout=subprocess.DEVNULL)
        shutil.move(Path(tmp) / f"serving_{model}.json", out)


def swings(path: Path) -> dict[tuple[str, int], tuple[float, float]]:
    """{(model, sessions): (first copy's swing, second copy's)} of one A/A JSON."""
    data = json.loads(path.read_text())
    model = model_option(data["args"]["server_args"])
    by: dict[int, dict[bool, float]] = {}
    for key, p95s in data["p95_by_round"].items():
        name, level = key.rsplit(" @", 1)
        by.setdefault(int(level), {})["#" in name] = max(p95s) - min(p95s)
    return {(model, level): (s[False], s[True]) for level, s in by.items()}


def report(paths: Sequence[Path]) -> list[str]:
    """Per cell: every run's two swings, how often the first was <= the second, and the median
    ratio of the wider to the narrower."""
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for path in paths:
        for cell, pair in swings(path).items():
            runs.setdefault(cell, []).append(pair)
    lines = [
        "| model | sessions | swings ms (copy 1 / copy 2), run by run | copy 1 <= copy 2 | "
        "median wider / narrower |",
        "|---|---|---|---|---|",
    ]
    for (model, level), pairs in sorted(runs.items()):
        shown = ", ".join(f"{a:.0f} / {b:.0f}" for a, b in pairs)
        le = sum(a <= b for a, b in pairs)
        ratio = statistics.median(max(a, b) / max(min(a, b), 1e-9) for a, b in pairs)
        lines.append(f"| {model} | {level} | {shown} | {le} of {len(pairs)} | {ratio:.2f} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default="marconi", help="a servers.py name (marconi, vllm-bind)")
    ap.add_argument("--cells", default="tiny:4,small:16", help="MODEL:SESSIONS, comma-separated")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("results/swing_aa"))
    ap.add_argument("--no-run", action="store_true", help="only tabulate --out's JSON files")
    args = ap.parse_args(argv)
    tag = args.server.replace("/", "_")
    if not args.no_run:
        args.out.mkdir(parents=True, exist_ok=True)
        for rep in range(args.repeats):
            for model, levels in parse_cells(args.cells).items():
                out = args.out / f"{tag}_{model}_{rep + 1}.json"
                print(f"A/A {args.server} {model} {levels}: {rep + 1}/{args.repeats}", flush=True)
                run_one(args.server, model, levels, args.rounds, out)
    paths = sorted(args.out.glob(f"{tag}_*.json"))
    if not paths:
        raise SystemExit(f"no {tag}_*.json in {args.out}")
    print(f"A/A runs of {args.server} ({len(paths)} files in {args.out})")
    print("\n".join(report(paths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

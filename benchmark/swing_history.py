"""Issue 13's swing line pooled over the full ``vs_vllm.sh`` runs recorded in the docs.

The line compares two single draws per cell (our per-round TTFT P95 spread over one run's
rounds against vLLM's), so one run says little (``swing_aa.py``). This reads every full run's
table in docs/performance.md and docs/performance_log.md, the rows written since session 32 as

    | tiny | 4 | 66 / 189 / 12 | 175 / 333 / 20 | **63 / 133** (124) |

(model, sessions, ours and vLLM bind 0-1's TTFT P50 / P95 / ITL P50, then the swings ours /
vLLM bind, vLLM's default binding in brackets; bold where the run met the line against vLLM's
better binding), and prints per cell how many runs met it, our median and summed swing against
vLLM bind's, and the chance that one run meets all six cells at those rates::

    .venv/bin/python benchmark/swing_history.py               # every full run since session 32
    .venv/bin/python benchmark/swing_history.py --since 38
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

DOCS = Path(__file__).resolve().parent.parent / "docs"
FILES = (DOCS / "performance.md", DOCS / "performance_log.md")
CELLS = (("tiny", 1), ("tiny", 4), ("tiny", 16), ("small", 1), ("small", 4), ("small", 16))
SESSION = re.compile(r"^#+ .*?[Ss]ession (\d+)")
ROW = re.compile(
    r"^\| (tiny|small) \| (\d+) \| [^|]+ \| [^|]+ \| "  # model, sessions, ours, vLLM bind
    r"(\*\*)?([\d,]+) / ([\d,]+)(\*\*)?( \([\d,]+\))? \|$"  # swings: **ours / bind** (default)
)


class Swing(NamedTuple):
    ours: int  # ms, max - min of our per-round TTFT P95
    bind: int  # the same for vLLM with VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>
    met: bool  # the run's verdict (against vLLM's better binding that run)


class Run(NamedTuple):
    session: int
    cells: dict[tuple[str, int], Swing]


def parse(lines: Iterable[str]) -> list[Run]:
    """Every table of swing rows under a heading that names a session; a block of rows is one
    run, kept if it has all six cells (re-runs of some cells are skipped)."""
    found: list[Run] = []
    session, block = None, {}

    def close() -> None:
        if session is not None and set(block) == set(CELLS):
            found.append(Run(session, dict(block)))
        block.clear()

    for line in lines:
        if line.startswith("#"):
            close()
            head = SESSION.match(line)
            session = int(head.group(1)) if head else None
            continue
        row = ROW.match(line)
        if row:
            ours, bind = (int(row.group(i).replace(",", "")) for i in (4, 5))
            block[(row.group(1), int(row.group(2)))] = Swing(ours, bind, bool(row.group(3)))
        elif not line.startswith("|"):
            close()
    close()
    return found


def recorded_runs(since: int) -> list[Run]:
    """The full runs in ``FILES`` from session ``since`` on, oldest first."""
    runs = [r for path in FILES for r in parse(path.read_text().splitlines())]
    return sorted((r for r in runs if r.session >= since), key=lambda r: r.session)


def report(runs: Sequence[Run]) -> list[str]:
    """Per cell over ``runs``: met, median and summed swings, ours against vLLM bind's."""
    lines = [
        f"{len(runs)} full runs, sessions {', '.join(str(r.session) for r in runs)}",
        "",
        "| model | sessions | met | median swing ms, ours / vLLM bind | summed, ours / vLLM bind |",
        "|---|---|---|---|---|",
    ]
    chance = 1.0
    for cell in CELLS:
        swings = [r.cells[cell] for r in runs]
        met = sum(s.met for s in swings)
        chance *= met / len(swings)
        med = (statistics.median(s.ours for s in swings), statistics.median(s.bind for s in swings))
        total = (sum(s.ours for s in swings), sum(s.bind for s in swings))
        lines.append(
            f"| {cell[0]} | {cell[1]} | {met} of {len(swings)} | {med[0]:g} / {med[1]:g} | "
            f"{total[0]:,} / {total[1]:,} |"
        )
    odds = f"about 1 in {1 / chance:.0f}" if chance > 0 else "never"
    lines += ["", f"one run meets all six cells at these rates (independent): {odds}"]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--since", type=int, default=32, help="first session to pool (its format)")
    args = ap.parse_args(argv)
    runs = recorded_runs(args.since)
    if not runs:
        raise SystemExit(f"no full runs since session {args.since} in {', '.join(map(str, FILES))}")
    print("\n".join(report(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

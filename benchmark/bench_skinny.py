"""The skinny decode kernel (``csrc/skinny_linear.c``) of this tree against another commit's.

Builds both versions of the kernel (the other from ``git show REV:...``, with that commit's
``csrc`` headers) as plain ctypes libraries, the way the engine builds its kernels, then calls them
alternately on the same inputs, in pairs whose order alternates. Each call runs every weight
of a decode step's layer set (``--shapes``, default the small model's: Mamba-2 in/out
projections, MLP up/down) over ``--copies`` copies, so the weights stream from memory as in a
decode step (``--copies 1`` on a weight set that fits L2 measures the compute instead). Prints,
per row count, the median (and quartiles) of the paired time ratios, this tree over REV, and
each build's best time::

    .venv/bin/python benchmark/bench_skinny.py --baseline HEAD~1 --rows 1,4,8,16

Run it with nothing else running, and say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from marconi.layers.ckernel import CSRC, compiler
from marconi.layers.linear import SKINNY

SMALL = "3352x768,768x1536,3072x768,768x3072"
Fn = Callable[..., None]


def build(src: Path, out: Path, extra: tuple[str, ...]) -> Fn:
    """The skinny kernel compiled from ``src`` into ``out`` and loaded, as the engine builds it
    (``CKernel.compile`` / ``load``: a ctypes library, since ``out`` is no extension module's
    file name). An absolute ``source`` replaces ``csrc/`` in ``CKernel.path``."""
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler found")
    kernel = dataclasses.replace(SKINNY, source=str(src.resolve()))
    return kernel.load(kernel.compile(cc, out, extra))


def checkout_csrc(rev: str, dest: Path) -> None:
    """The ``csrc`` folder as of ``rev`` into ``dest``."""
    rel = CSRC.relative_to(Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"],
                                                        text=True).strip()))  # fmt: skip
    dest.mkdir(parents=True)
    names = subprocess.check_output(["git", "ls-tree", "--name-only", rev, f"{rel}/"], text=True)
    for name in names.split():
        blob = subprocess.check_output(["git", "show", f"{rev}:{name}"])
        (dest / Path(name).name).write_bytes(blob)


def time_pairs(
    fns: tuple[Fn, Fn], xs: dict[int, torch.Tensor], weights: list[torch.Tensor], threads: int,
    rounds: int,
) -> tuple[list[float], list[float]]:  # fmt: skip
    """Per round, each build's seconds for one call per weight, the order alternating."""
    times: tuple[list[float], list[float]] = ([], [])
    calls = [(xs[w.shape[1]], w, torch.empty(xs[w.shape[1]].shape[0], w.shape[0])) for w in weights]
    for r in range(rounds):
        for v in (0, 1) if r % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            for x, w, y in calls:
                (m, k), n = x.shape, w.shape[0]
                fns[v](x.data_ptr(), w.data_ptr(), None, y.data_ptr(), m, n, k, threads)
            times[v].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision to compare against")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--shapes", default=SMALL, help="weights NxK, comma-separated")
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--cflags", default="", help="extra compiler flags, e.g. -mno-avx512f")
    args = ap.parse_args()
    extra = tuple(args.cflags.split())
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "base"
        checkout_csrc(args.baseline, base_dir)
        fns = (
            build(SKINNY.path, Path(tmp) / "this.so", extra),
            build(base_dir / SKINNY.source, Path(tmp) / "base.so", extra),
        )
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=g) for _ in range(args.copies) for n, k in shapes]
        mb = sum(w.numel() for w in weights) * 4 / 2**20
        print(f"# {platform.processor() or platform.machine()}, {args.threads} threads, "
              f"{len(weights)} weights ({mb:.0f} MB), baseline {args.baseline}, cflags "
              f"{args.cflags or '-'}")  # fmt: skip
        print("| rows | this / baseline, median paired ratio (q1-q3) | best us: this | baseline "
              "| bit-identical |")  # fmt: skip
        print("|---|---|---|---|---|")
        for m in (int(v) for v in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=g) for _, k in shapes}
            same = True
            for w in weights[: len(shapes)]:  # the builds agree (fp32, any summation order)
                y = [torch.empty(m, w.shape[0]) for _ in fns]
                x = xs[w.shape[1]]
                for fn, out in zip(fns, y, strict=True):
                    fn(x.data_ptr(), w.data_ptr(), None, out.data_ptr(), m, *w.shape, args.threads)
                torch.testing.assert_close(y[0], y[1], rtol=1e-4, atol=1e-3)
                same = same and torch.equal(y[0], y[1])
            this, base = time_pairs(fns, xs, weights, args.threads, args.rounds)
            ratios = sorted(a / b for a, b in zip(this, base, strict=True))
            q = statistics.quantiles(ratios, n=4)
            scale = 1e6 / args.copies
            ratio = f"{statistics.median(ratios):.3f} ({q[0]:.3f}-{q[2]:.3f})"
            best = f"{min(this) * scale:.0f} | {min(base) * scale:.0f}"
            cells = (ratio, best, "yes" if same else "no")
            print(f"| {m} | {' | '.join(cells)} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

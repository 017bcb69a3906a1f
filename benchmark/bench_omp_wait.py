"""Prefill time under OpenMP wait policies, each in its own process, interleaved rounds.

GNU OpenMP (torch's) reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, when torch loads, so
each variant runs in a fresh process: ``--tokens`` random tokens prefilled ``--reps`` times on
``--threads`` intra-op threads (the engine's own step loop, no HTTP), median ms per variant
and round. Run it quiet and again with a competing process on a core (``--load``: a busy-loop
process at nice 15 for the whole run; ``--load 2``: one per core) to see both sides::

    .venv/bin/python benchmark/bench_omp_wait.py --variants ACTIVE,PASSIVE,spin=10000
    .venv/bin/python benchmark/bench_omp_wait.py --variants ACTIVE,PASSIVE --load
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time, numpy as np
from marconi.engine import Engine, EngineConfig, SamplingParams
import torch
model, tokens, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
e = Engine(EngineConfig(model=model, prefix_cache="none", cache_memory="512MB",
                        chunked_prefill_size=tokens))
e.runner.max_threads = threads
rng, vocab, out = np.random.default_rng(0), e.model.config.vocab_size, []
for _ in range(reps + 1):
    ids = rng.integers(5, min(vocab, 250), size=tokens, dtype=np.int64)
    e.add_request(e.make_request(ids, SamplingParams(max_tokens=1, temperature=0.0)))
    t0 = time.perf_counter()
    while e.has_unfinished():
        e.step()
    out.append(1e3 * (time.perf_counter() - t0))
print(json.dumps(out[1:]))
"""


def variant_env(name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if name.startswith("spin="):
        env["OMP_WAIT_POLICY"] = ""  # neither: libgomp spins GOMP_SPINCOUNT times, then sleeps
        env["GOMP_SPINCOUNT"] = name.partition("=")[2]
    else:
        env["OMP_WAIT_POLICY"] = name
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="ACTIVE,PASSIVE")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--load",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="N nice-15 busy-loop processes (default 1) for the whole run",
    )
    args = ap.parse_args()
    busy = ["nice", "-n", "15", sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(busy) for _ in range(args.load)]
    names = args.variants.split(",")
    got: dict[str, list[float]] = {n: [] for n in names}
    try:
        for r in range(args.rounds):
            for n in names:
                cmd = [sys.executable, "-c", CHILD, args.model, str(args.tokens),
                       str(args.threads), str(args.reps)]  # fmt: skip
                out = subprocess.run(cmd, env=variant_env(n), capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(out.stderr)
                ms = json.loads(out.stdout.strip().splitlines()[-1])
                got[n] += ms
                print(f"round {r + 1} {n}: {' '.join(f'{x:.0f}' for x in ms)} ms", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    print(f"\n{args.model}, {args.tokens}-token prefill, {args.threads} threads, "
          f"{args.load} nice-15 busy-loop processes")  # fmt: skip
    print("| variant | median ms | min ms | max ms |\n|---|---|---|---|")
    for n, ms in got.items():
        print(f"| {n} | {statistics.median(ms):.0f} | {min(ms):.0f} | {max(ms):.0f} |")


if __name__ == "__main__":
    main()

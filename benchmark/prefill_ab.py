"""Prefill throughput of two engine environments, interleaved: an A/B for settings read at start-up.

Two worker processes load the same model (``Engine``, prefix cache off, no HTTP), one with each
environment (``--env-a`` / ``--env-b``: ``NAME=VALUE`` pairs, comma-separated; empty: the
defaults), and prefill the same blocks of random-length prompts in turns (A then B, B then A,
...), so that the machine's drift hits both alike. Prints the B / A time per block (median, and
the mean over the second half, once both have run long enough to reach their steady state) and
each worker's RSS at the end. An A/A run (same environment twice) shows the noise::

    .venv/bin/python benchmark/prefill_ab.py --model tiny \
        --env-a ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 --blocks 60 --per-block 10

Runs both workers on the same cores: say what else was running.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np


def worker(model: str, seed: int) -> None:
    """Reads lines of prompt lengths on stdin, prefills each (one token out), prints seconds."""
    from marconi.engine.affinity import pin_threads
    from marconi.engine.config import EngineConfig
    from marconi.engine.engine import Engine
    from marconi.engine.request import SamplingParams

    engine = Engine(EngineConfig(model=model, prefix_cache="none", cache_memory="512MB"))
    pin_threads()
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print("ready", flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        for n in map(int, line.split()):
            ids = rng.integers(5, vocab, size=n, dtype=np.int64)
            engine.add_request(engine.make_request(ids, params))
            while engine.has_unfinished():
                engine.step()
        print(time.perf_counter() - t0, flush=True)


def parse_env(text: str) -> dict[str, str]:
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--env-a/--env-b: NAME=VALUE pairs, got {text!r}")
    return dict(pairs)  # type: ignore[arg-type]


def spawn(model: str, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", "--model", model]
    proc = subprocess.Popen(
        cmd, env=os.environ | env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--env-a", default="", help="NAME=VALUE,... for worker A")
    ap.add_argument("--env-b", default="", help="NAME=VALUE,... for worker B")
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--per-block", type=int, default=10, help="prompts per block")
    ap.add_argument("--min-len", type=int, default=17)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.model, args.seed)
        return
    procs = {k: spawn(args.model, parse_env(e)) for k, e in (("A", args.env_a), ("B", args.env_b))}
    rng = np.random.default_rng(args.seed)
    secs: dict[str, list[float]] = {"A": [], "B": []}
    for b in range(args.blocks):
        block = rng.integers(args.min_len, args.max_len + 1, size=args.per_block)
        line = " ".join(map(str, block)) + "\n"
        for k in ("A", "B") if b % 2 == 0 else ("B", "A"):
            p = procs[k]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(line)
            p.stdin.flush()
            secs[k].append(float(p.stdout.readline()))
    rss = {k: rss_mb(p.pid) for k, p in procs.items()}
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.close()
        p.wait()
    a, b = np.array(secs["A"]), np.array(secs["B"])
    ratio = b / a
    print(f"model {args.model}, {args.blocks} blocks of {args.per_block} prompts "
          f"({args.min_len}-{args.max_len} tokens)")  # fmt: skip
    print(f"A ({args.env_a or 'defaults'}): {a.sum():.1f} s, RSS {rss['A']:.0f} MB")
    print(f"B ({args.env_b or 'defaults'}): {b.sum():.1f} s, RSS {rss['B']:.0f} MB")
    print(f"B / A per block: median {np.median(ratio):.3f}, "
          f"second half mean {ratio[args.blocks // 2:].mean():.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

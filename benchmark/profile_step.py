"""Where one engine step's time goes: scheduling, forward, sampling, postprocessing.

Drives ``Engine.step()`` directly (no HTTP) on fixed batches: ``--batch`` requests of
``--prompt-len`` random tokens, prefilled, then ``--steps`` decode steps timed per phase (the
phases are the engine's own methods, timed by wrapping them on this engine instance). Prints the
median milliseconds per phase and the model forward alone (``model(...)`` on the same batch).
Like the server's engine thread, this (only) torch thread pins its OpenMP team when the team
fills the CPUs (``affinity.pin_threads``; ``--no-pin-threads``: never)::

    .venv/bin/python benchmark/profile_step.py --model tiny --batch 1,4,16 --steps 32

Only the split is meaningful on a loaded machine; say what else was running.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from marconi.engine.affinity import pin_threads
from marconi.engine.config import EngineConfig
from marconi.engine.engine import Engine
from marconi.engine.request import SamplingParams

PHASES = ("schedule", "forward", "sample", "postprocess")


def _timed(store: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store[name].append(1e3 * (time.perf_counter() - t0))

    return wrapper


def profile(model: str, batch: int, prompt_len: int, steps: int, seed: int) -> dict[str, float]:
    engine = Engine(EngineConfig(model=model, prefix_cache="marconi", cache_memory="512MB"))
    times: dict[str, list[float]] = defaultdict(list)
    sched, runner = engine.scheduler, engine.runner
    sched.schedule = _timed(times, "schedule", sched.schedule)  # type: ignore[method-assign]
    sched.postprocess = _timed(times, "postprocess", sched.postprocess)  # type: ignore[method-assign]
    runner.forward = _timed(times, "forward", runner.forward)  # type: ignore[method-assign]
    runner.sample = _timed(times, "sample", runner.sample)  # type: ignore[method-assign]
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        ids = rng.integers(5, vocab, size=prompt_len, dtype=np.int64)
        engine.add_request(engine.make_request(ids, params))
    reqs = list(engine.scheduler.waiting)
    while not all(r.output_ids for r in reqs):  # prefill, until every request decodes
        engine.step()
    times.clear()
    step_ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_ms.append(1e3 * (time.perf_counter() - t0))
    out = {k: statistics.median(v) for k, v in times.items()}
    out["step"] = statistics.median(step_ms)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pin-threads", action=argparse.BooleanOptionalAction, default=None)
    args = ap.parse_args()
    if args.pin_threads is not False:
        print(f"OpenMP threads pinned to CPUs {pin_threads(args.pin_threads)}")
    print(f"| batch | step ms | {' | '.join(PHASES)} | other |")
    print("|---|---|" + "---|" * (len(PHASES) + 1))
    for b in (int(x) for x in args.batch.split(",")):
        r = profile(args.model, b, args.prompt_len, args.steps, args.seed)
        other = r["step"] - sum(r.get(p, 0.0) for p in PHASES)
        cells = " | ".join(f"{r.get(p, 0.0):.2f}" for p in PHASES)
        print(f"| {b} | {r['step']:.2f} | {cells} | {other:.2f} |", flush=True)


if __name__ == "__main__":
    main()

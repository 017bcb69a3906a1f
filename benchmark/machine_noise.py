"""How much this machine's speed moves between windows of identical work (issue 13's swing line).

Times ``--windows`` repetitions of the same work, one after another, in this process:

- ``gemm``: a fixed fp32 matmul loop (256 x 1024 by 1024 x 4096, torch's own kernels), the
  shape of a prefill step's projections;
- ``burst`` (with ``--model``): the engine (no HTTP, prefix cache off) serving the opening burst
  of ``bench_serving.py``'s small replay, six prompts of 71-349 tokens, 16 tokens out each.

Prints each window's milliseconds, the range as a share of the fastest, and the CPU time the
hypervisor took (``steal`` in ``/proc/stat``) while it ran. A server's per-round TTFT P95 swing
cannot be narrower than the machine's own swing over windows of the same length::

    .venv/bin/python benchmark/machine_noise.py --windows 12 --model small

Run it with nothing else running, and say so.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import numpy as np
import torch

BURST = (71, 143, 349, 172, 179, 190)  # bench_serving.py's small replay, first turns


def steal_ticks() -> int:
    """Ticks (1/100 s, all CPUs) the hypervisor ran something else while we were runnable."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) if len(fields) > 8 else 0


def gemm_work(loops: int) -> Callable[[], None]:
    a, w = torch.randn(256, 1024), torch.randn(4096, 1024)

    def run() -> None:
        for _ in range(loops):
            a @ w.T

    return run


def burst_work(model: str) -> Callable[[], None]:
    from marconi.engine import LLM, SamplingParams

    llm = LLM(model, "none")
    rng = np.random.default_rng(0)
    vocab = llm.engine.model.config.vocab_size
    prompts = [rng.integers(5, vocab, n).tolist() for n in BURST]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return lambda: llm.generate(prompts, params)


def measure(name: str, run: Callable[[], None], windows: int) -> None:
    run()  # warm-up: kernels built, memory touched
    times, s0 = [], steal_ticks()
    for _ in range(windows):
        t = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - t))
    ms = np.array(times)
    print(
        f"{name}: {' '.join(f'{t:.0f}' for t in ms)} ms; min {ms.min():.0f}, median "
        f"{np.median(ms):.0f}, max {ms.max():.0f}: range {100 * np.ptp(ms) / ms.min():.1f}% of "
        f"the fastest; steal {(steal_ticks() - s0) / 100:.2f} CPU-s in {ms.sum() / 1000:.1f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--gemm-loops", type=int, default=150, help="matmuls per gemm window")
    ap.add_argument("--model", help="also time the engine's burst on this model (tiny, small)")
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    cpu = names[0] if names else platform.processor()
    print(f"cpu: {cpu}, {torch.get_num_threads()} torch threads; load before: {load}")
    measure("gemm", gemm_work(args.gemm_loops), args.windows)
    if args.model:
        measure(f"burst ({args.model})", burst_work(args.model), args.windows)


if __name__ == "__main__":
    main()

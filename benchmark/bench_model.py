"""Prefill / decode speed of our hybrid runtime vs `transformers` on the same weights.

    python benchmark/bench_model.py --quick            # tiny + 150m, 512/2048, 1 thread, < 5 min
    python benchmark/bench_model.py --models tiny,150m --lengths 512,2048,8192 --threads 1,2

Prints one markdown table (tokens/s, ms/token and our/transformers ratios) plus the cost of
restoring a cached state against the prefill it saves. Weights are written once in HF format and
loaded by both runtimes, so both see identical parameters. Both runtimes run in the same process,
back to back, interleaved `--reps` times (ours, transformers, ours, ...); each column is the best
of its repetitions, so a noisy neighbour on a shared machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from marconi.layers import small_m
from marconi.models import ForwardBatch, HybridForCausalLM, SequenceInput, load_model
from marconi.models.tiny import ensure_tiny


def _folder(name: str) -> Path:
    """`tiny`, `150m` (the embedded `small`) or a local HF folder."""
    if name in ("tiny", "150m"):
        return ensure_tiny({"150m": "small"}.get(name, name))
    return Path(name)


def _interleaved(fns: list[Callable[[], Any]], reps: int) -> list[float]:
    """Best wall time of each fn over `reps` rounds that run every fn once, in turn."""
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _best(fn: Callable[[], Any], reps: int) -> float:
    return _interleaved([fn], reps)[0]


def _ours_prefill(model: HybridForCausalLM, ids: list[int]) -> Callable[[], Any]:
    mem = model.allocate_memory(len(ids) + 1, 2)
    return lambda: model(ForwardBatch((SequenceInput(ids, list(range(len(ids))), 0),)), mem)


def _ours_decode(model: HybridForCausalLM, ids: list[int], steps: int) -> float:
    mem = model.allocate_memory(len(ids) + steps + 1, 2)
    n = len(ids)
    tok = int(model(ForwardBatch((SequenceInput(ids, list(range(n)), 0),)), mem).logits[0].argmax())
    t0 = time.perf_counter()
    for i in range(steps):
        req = SequenceInput([tok], list(range(n + i + 1)), 0)
        tok = int(model(ForwardBatch((req,)), mem).logits[0].argmax())
    return (time.perf_counter() - t0) / steps


def _hf_decode(hf: Any, ids: list[int], steps: int) -> float:
    x = torch.tensor([ids])
    kw = {"do_sample": False, "pad_token_id": 258}
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        hf.generate(x, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kw)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,150m")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (best of)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny + 150m, prefill 512/2048 (150m: 512), 1 thread, 2 reps: under 5 minutes",
    )
    args = ap.parse_args()
    if args.quick:
        args.models, args.lengths, args.threads, args.reps = "tiny,150m", "512,2048", "1", 2
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = [
        "| model | threads | metric | ours | transformers | ratio |",
        "|---|---|---|---|---|---|",
    ]
    g = torch.Generator().manual_seed(0)
    for name in args.models.split(","):
        folder = _folder(name)
        ours = load_model(folder, device=dev)
        params = sum(p.numel() for p in ours.parameters()) / 1e6
        hf = None
        if not args.no_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
        label = f"{name} ({params:.0f}M)"
        for th in map(int, args.threads.split(",")):
            torch.set_num_threads(th)
            small_m.set_threads(th)  # our decode kernel's own threads, as the engine sets them
            for length in map(int, args.lengths.split(",")):
                if args.quick and name != "tiny" and length > 512:
                    continue
                ids = torch.randint(0, 256, (length,), generator=g).tolist()
                run = _ours_prefill(ours, ids)
                _ours_prefill(ours, ids[:64])()  # warm-up (first-call allocations)
                fns: list[Callable[[], Any]] = [lambda run=run: (run(), sync())]
                if hf is not None:
                    x = torch.tensor([ids], device=dev)

                    def hf_run(x: torch.Tensor = x, m: Any = hf) -> None:
                        with torch.no_grad():
                            m(x, use_cache=False)
                        sync()

                    hf_run(torch.tensor([ids[:64]], device=dev))  # warm-up
                    fns.append(hf_run)
                times = _interleaved(fns, args.reps)
                t_ours = times[0]
                theirs = (
                    ("-", "-")
                    if hf is None
                    else (f"{length / times[1]:,.0f}", f"{times[1] / t_ours:.2f}x")
                )
                rows.append(
                    f"| {label} | {th} | prefill {length} tok/s | {length / t_ours:,.0f} "
                    f"| {theirs[0]} | {theirs[1]} |"
                )
                print(rows[-1], flush=True)
            ctx = torch.randint(0, 256, (args.decode_context,), generator=g).tolist()
            d_ours = d_hf = float("inf")
            for _ in range(args.reps):  # interleaved, best of
                # ours decodes as the engine runs it: one intra-op thread, the C kernel's own
                # threads for the weights (``ModelRunner._set_threads``); transformers: th threads
                torch.set_num_threads(1 if dev.type == "cpu" else th)
                d_ours = min(d_ours, _ours_decode(ours, ctx, args.decode_steps))
                torch.set_num_threads(th)
                if hf is not None:
                    d_hf = min(d_hf, _hf_decode(hf, ctx, args.decode_steps))
            theirs = ("-", "-") if hf is None else (f"{d_hf * 1e3:.2f}", f"{d_hf / d_ours:.2f}x")
            rows.append(
                f"| {label} | {th} | decode ms/token (ctx {args.decode_context}) "
                f"| {d_ours * 1e3:.2f} | {theirs[0]} | {theirs[1]} |"
            )
            print(rows[-1], flush=True)
        # restoring a cached state (one slot copy) vs re-running the prefix it stands for
        mem = ours.allocate_memory(2, 4)
        t_copy = _best(lambda mem=mem: (mem.copy_state(0, 1), sync()), 20)
        print(
            f"{label}: state slot {mem.state_bytes_per_slot / 1e6:.2f} MB, restore "
            f"{t_copy * 1e6:.0f} us (vs prefill times above)",
            flush=True,
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()

"""Short multi-turn replay against SGLang's native ``/generate`` API with token ids.

Used by ``sglang_check.sh`` (GPU only). The tiny random models have a byte vocabulary and no
tokenizer files, so the server runs with ``--skip-tokenizer-init`` and requests carry
``input_ids``; that is why this is not ``benchmark/bench_serving.py`` (text prompts).

Workload: ``--sessions`` chat sessions share a system prompt; each has ``--turns`` turns; turn
k+1's prompt = turn k's prompt + the generated reply + new user tokens (the chat pattern where
Marconi's "last decoded token" states pay off). Sessions run concurrently, turns in order.
Prints one JSON line: TTFT P50/P95 (ms) and the token hit rate (``meta_info.cached_tokens`` /
``prompt_tokens``).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import requests


def one_request(url: str, ids: list[int], max_new: int) -> tuple[float, list[int], int, int]:
    """Stream one generation; returns (ttft s, output ids, prompt tokens, cached tokens)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, out, meta = float("nan"), [], {}
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            if ttft != ttft:  # first chunk
                ttft = time.perf_counter() - t0
            msg = json.loads(line[5:])
            out = msg.get("output_ids", out)
            meta = msg.get("meta_info", meta)
    return (
        ttft,
        list(out),
        int(meta.get("prompt_tokens", len(ids))),
        int(meta.get("cached_tokens", 0)),
    )


def session(url: str, seed: int, system: list[int], args: argparse.Namespace) -> list[tuple]:
    rng = random.Random(seed)
    history = list(system)
    rows = []
    for _ in range(args.turns):
        history += [rng.randrange(0, 256) for _ in range(args.user_len)]
        ttft, out, prompt, cached = one_request(url, history, args.output_len)
        rows.append((ttft, prompt, cached))
        history += out
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--label", default="")
    args = p.parse_args()
    system = [random.Random(0).randrange(0, 256) for _ in range(args.system_len)]
    with ThreadPoolExecutor(args.concurrency) as pool:
        futs = [pool.submit(session, args.url, s, system, args) for s in range(args.sessions)]
        rows = [r for f in futs for r in f.result()]
    ttft = np.array([r[0] for r in rows]) * 1e3
    prompt, cached = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(json.dumps({
        "label": args.label,
        "requests": len(rows),
        "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 2),
        "ttft_p95_ms": round(float(np.percentile(ttft, 95)), 2),
        "hit_rate": round(cached / max(prompt, 1), 4),
    }))  # fmt: skip


if __name__ == "__main__":
    main()

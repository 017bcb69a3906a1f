"""Soak test (a benchmark, not a timed test): thousands of mixed requests against a live server.

Each request is one of the kinds in ``KINDS`` (chat or completions, streamed or not, clients that
hang up mid-stream or while waiting, half-sent bodies, bad inputs), drawn at random with a fixed
seed. Reports outcomes by kind (server-side errors, 5xx or a streamed error event, must be 0;
bad inputs must get 4xx), the server's RSS at start (after a warm-up) and end, and the cache's
deep integrity check with nothing in flight at the end. Exits 1 if any of that fails or the RSS
grew by more than ``--rss-bound-mb``.

    python benchmark/soak.py --launch marconi --requests 3000      # starts our server
    python benchmark/soak.py --base-url http://127.0.0.1:30000 --pid 1234 --api-key KEY
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


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def soak(args: argparse.Namespace, url: str, pid: int | None) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as cli:
        s = Soak(cli, url, rng, args.api_key)
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

        warm = min(args.warmup, len(kinds))
        await asyncio.gather(*(one(k) for k in kinds[:warm]))
        rss0, t0 = rss_mb(pid), time.perf_counter()
        samples = []  # RSS after each tenth of the requests: growth vs a plateau
        rest = kinds[warm:]
        for i in range(10):
            part = rest[i * len(rest) // 10 : (i + 1) * len(rest) // 10]
            await asyncio.gather(*(one(k) for k in part))
            samples.append(rss_mb(pid))
        elapsed = time.perf_counter() - t0
        idle = await wait_idle(cli, s.auth)
    return {
        "requests": args.requests,
        "seconds": round(elapsed, 1),
        "outcomes": {f"{k}: {o}": n for (k, o), n in sorted(outcomes.items())},
        "server_errors": sum(n for (_, o), n in outcomes.items() if o not in GOOD),
        "rss_start_mb": rss0,
        "rss_end_mb": rss_mb(pid),
        "rss_samples_mb": [None if x is None else round(x) for x in samples],
        "integrity": idle,
    }


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
    p.add_argument("--pid", type=int, default=None, help="the running server's pid (for RSS)")
    p.add_argument("--launch", default="marconi", help="start our server with this policy")
    p.add_argument("--server-args", default="--cache-memory 256MB --num-threads 1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200, help="requests before the RSS baseline")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-bound-mb", type=float, default=64.0)
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    proc = None
    if args.base_url is None:
        if args.api_key:
            args.server_args += f" --api-key {args.api_key}"
        server = launch(args.launch, args.server_args)
        proc, url = server.proc, server.url
        pid: int | None = proc.pid
    else:
        url, pid = args.base_url, args.pid
    try:
        report = asyncio.run(soak(args, url, pid))
    finally:
        if proc is not None:
            proc.terminate()
            report_rc = proc.wait(60)
    if proc is not None:
        report["exit_code_after_sigterm"] = report_rc
    drift = None
    if report["rss_start_mb"] is not None and report["rss_end_mb"] is not None:
        drift = report["rss_end_mb"] - report["rss_start_mb"]
    report["rss_drift_mb"] = drift
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    failed = (
        report["server_errors"] > 0
        or not report["integrity"]["ok"]
        or (drift is not None and drift > args.rss_bound_mb)
        or report.get("exit_code_after_sigterm", 0) != 0
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

"""Client faults and shutdown (issue 12), bounded: a few hundred clients that hang up at random
points (mid-stream, while queued, half-way through their body) leave nothing in flight; SIGTERM
under load drains (in-flight requests finish or get a clean 503) and the process exits 0 after
its own cache check."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from marconi.launch_server import ServerHandle, free_port

from .conftest import start_server, stop_server, wait_idle

CLIENTS = 200
KINDS = ("stream_cut", "wait_cut", "half_body", "complete")


@pytest.fixture(scope="module")
def busy() -> Iterator[ServerHandle]:
    """Eight requests run at once, so many of the clients below hang up while queued."""
    srv = start_server(prefix_cache="marconi", max_running_requests=8, cache_memory="128MB")
    yield srv
    stop_server(srv)


async def one_client(cli: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    kind = rng.choice(KINDS)
    body = {"prompt": f"client {rng.randrange(10**6)} says", "max_tokens": rng.randint(2, 12)}
    if kind == "stream_cut":  # read 0-5 events, then hang up
        async with cli.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            n = rng.randint(0, 5)
            async for _ in r.aiter_lines():
                n -= 1
                if n < 0:
                    break
    elif kind == "wait_cut":  # give up after 20-500 ms: queued, prefilling or decoding
        with contextlib.suppress(httpx.TimeoutException):
            await cli.post("/v1/completions", json=body, timeout=rng.uniform(0.02, 0.5))
    elif kind == "half_body":
        host, port = url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        raw = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(raw)}\r\n\r\n"
        writer.write(head.encode() + raw[: rng.randrange(len(raw))])
        await writer.drain()
        writer.close()
    else:
        r = await cli.post("/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    return kind


def test_random_disconnects_leave_nothing_in_flight(busy: ServerHandle) -> None:
    rng = random.Random(12)

    async def run() -> Counter:
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=busy.url, timeout=120) as cli:

            async def bounded() -> str:
                async with sem:
                    return await one_client(cli, busy.url, rng)

            return Counter(await asyncio.gather(*(bounded() for _ in range(CLIENTS))))

    kinds = asyncio.run(asyncio.wait_for(run(), 300))
    assert sum(kinds.values()) == CLIENTS and all(kinds[k] > 25 for k in KINDS), kinds
    wait_idle(busy.url, timeout=30)  # integrity OK, zero KV pages / state slots in flight
    metrics = httpx.get(f"{busy.url}/metrics").text
    aborted = next(
        float(x.split()[-1])
        for x in metrics.splitlines()
        if x.startswith('marconi_requests_total{finish_reason="abort"}')
    )
    assert aborted > 25, aborted
    ok = httpx.post(f"{busy.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def stream_outcome(url: str, body: dict) -> str:
    """How one streamed request ended: its finish reason, or the error code it got."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                return f"{r.status_code} {r.json()['error']['code']}"
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
            assert last is not None
            if "error" in last:
                return f"event {last['error']['code']}"
            return last["choices"][0]["finish_reason"]
    except httpx.ConnectError:
        return "refused"  # arrived after the listener closed


def gauge(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return next(
        float(x.split()[-1]) for x in lines if x.startswith(f"marconi_num_requests_{name} ")
    )


def test_sigterm_under_load_drains_and_exits_0() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "marconi.launch_server", "--port", str(port), "--num-threads"]
    cmd += ["1", "--cache-memory", "128MB", "--max-running-requests", "2", "--drain-timeout", "3"]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    log: list[str] = []
    started = threading.Event()

    def read_log() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if "marconi serving" in line:
                started.set()

    threading.Thread(target=read_log, daemon=True).start()
    try:
        assert started.wait(120), "".join(log)
        outcomes: list[str] = []
        short = {"prompt": "a short one", "max_tokens": 8, "stream": True}
        long = {"prompt": "a long one", "max_tokens": 20000, "ignore_eos": True, "stream": True}
        threads = [
            threading.Thread(target=lambda b=b: outcomes.append(stream_outcome(url, b)))
            for b in (long, long, short, long, short, long)  # 2 run, the rest wait
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while gauge(url, "running") < 2 or gauge(url, "waiting") < 2:
            assert time.monotonic() < deadline, "load did not build up"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(log)  # drain 3 s + the final check
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    clean = {"stop", "length", "503 shutting_down", "event shutting_down"}
    assert len(outcomes) == 6 and set(outcomes) <= clean, outcomes
    assert outcomes.count("event shutting_down") >= 2, outcomes  # the long running ones
    assert any("cache integrity OK, nothing in flight" in line for line in log), "".join(log)

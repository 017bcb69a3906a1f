"""Real servers on loopback ports (uvicorn on a thread, in-process engine) for the API tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from marconi.engine.config import EngineConfig
from marconi.launch_server import ServerArgs, ServerHandle, free_port
from marconi.server.guard import Limits

torch.set_num_threads(1)

#: Bans every non-ASCII byte and the specials (ids 128..259 of the tiny byte-level model), so
#: replies round-trip exactly through text and a conversation's next turn extends the cached one.
ASCII_ONLY = {str(t): -100 for t in range(128, 260)}


def start_server(limits: Limits | None = None, **engine_kwargs: object) -> ServerHandle:
    config = EngineConfig(**{"model": "tiny", "cache_memory": "96MB", **engine_kwargs})
    return ServerHandle(config, ServerArgs(port=free_port(), log_level="warning"), limits)


def stop_server(srv: ServerHandle) -> None:
    """Stop ``srv`` and assert that the shutdown check found nothing in flight."""
    assert srv.stop(drain=5) is None


def wait_idle(url: str, timeout: float = 20.0, headers: dict | None = None) -> dict:
    """Poll /debug/cache until no request is in flight; assert integrity and no leaked slot."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/debug/cache", timeout=10, headers=headers)
        body = r.json()
        assert r.status_code == 200 and body["ok"], body
        size = body["size"]
        if body["running"] == 0 and body["waiting"] == 0:
            assert size["kv_in_flight"] == 0 and size["state_in_flight"] == 0, size
            assert size["kv_locked"] == 0 and size["state_locked"] == 0, size
            return body
        assert time.monotonic() < deadline, f"requests still in flight: {body}"
        time.sleep(0.1)


@pytest.fixture(scope="package")
def marconi_server() -> Iterator[ServerHandle]:
    srv = start_server(prefix_cache="marconi", context_length=2048, chunked_prefill_size=64)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="package")
def plain_server() -> Iterator[ServerHandle]:
    srv = start_server(prefix_cache="none")
    yield srv
    stop_server(srv)

"""Load test (bounded, loopback only): 32 concurrent streaming chat clients, two turns each."""

from __future__ import annotations

import asyncio

import openai
import pytest
from marconi.launch_server import ServerHandle

from .conftest import ASCII_ONLY, start_server, wait_idle

CLIENTS = 32
SYSTEM = "You are a helpful assistant. Be brief."


async def session(cli: openai.AsyncOpenAI, i: int) -> list[tuple[str, int, str]]:
    """Two streamed turns; returns (finish reason, cached tokens, reply) per turn."""
    msgs = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(2):
        msgs.append({"role": "user", "content": f"client {i}, turn {turn}"})
        stream = await cli.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=8,
            temperature=0.7,
            seed=i,
            logit_bias=ASCII_ONLY,
            stream=True,
            stream_options={"include_usage": True},
        )
        reply, finish, cached = [], None, -1
        async for chunk in stream:
            if chunk.choices:
                reply.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
        msgs.append({"role": "assistant", "content": "".join(reply)})
        out.append((finish, cached, "".join(reply)))
    return out


@pytest.fixture(scope="module")
def load_server():
    srv = start_server(prefix_cache="marconi", cache_memory="256MB", max_running_requests=32)
    yield srv
    srv.stop()


def test_32_concurrent_streaming_clients_finish_without_errors_or_leaks(
    load_server: ServerHandle,
) -> None:
    async def run() -> list[list[tuple[str, int, str]]]:
        cli = openai.AsyncOpenAI(
            base_url=f"{load_server.url}/v1", api_key="x", max_retries=0, timeout=120
        )
        async with cli:
            return await asyncio.wait_for(
                asyncio.gather(*(session(cli, i) for i in range(CLIENTS))), timeout=240
            )

    results = asyncio.run(run())
    assert len(results) == CLIENTS
    for turns in results:
        for finish, cached, reply in turns:
            assert finish == "length" and cached >= 0 and len(reply) == 8
    # every second turn resumes from its first turn's final state
    assert all(turns[1][1] > len(SYSTEM) for turns in results), [t[1][1] for t in results]
    wait_idle(load_server.url)

"""``AsyncEngine`` builds its engine on the thread that steps it (the only thread of a server
that runs parallel torch ops: see the module docstring of ``marconi.engine.async_engine``), and
a build that fails fails ``start()``."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from marconi.engine import Engine, EngineConfig, SamplingParams
from marconi.engine.async_engine import AsyncEngine

torch.set_num_threads(1)


def test_built_and_stepped_on_one_thread_not_the_callers() -> None:
    threads: dict[str, set[int]] = {"build": set(), "step": set()}

    def build() -> Engine:
        threads["build"].add(threading.get_ident())
        engine = Engine(EngineConfig(model="tiny", cache_memory="64MB"))
        step = engine.step

        def traced_step():  # type: ignore[no-untyped-def]
            threads["step"].add(threading.get_ident())
            return step()

        engine.step = traced_step  # type: ignore[method-assign]
        return engine

    front = AsyncEngine(build)
    front.start()
    assert threads["build"] and threading.get_ident() not in threads["build"]

    async def generate() -> list[int]:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        req = front.engine.make_request(list(b"Hello there"), params)
        q = front.submit(req)
        while not (await q.get()).finished:
            pass
        return req.output_ids

    assert len(asyncio.run(generate())) == 4
    assert threads["step"] == threads["build"]
    assert front.shutdown() is None


def test_a_failed_build_fails_start() -> None:
    def build() -> Engine:
        raise ValueError("no such model: nowhere")

    front = AsyncEngine(build)
    with pytest.raises(ValueError, match="no such model"):
        front.start()


def test_a_burst_that_wakes_the_idle_engine_is_stepped_together() -> None:
    """With ``burst_wait``, requests that arrive within it of each other share the first step
    (the first alone would otherwise prefill alone: the module docstring)."""
    admitted: list[int] = []

    def build() -> Engine:
        engine = Engine(EngineConfig(model="tiny", cache_memory="64MB"))
        step = engine.step

        def traced_step():  # type: ignore[no-untyped-def]
            out = step()
            admitted.append(len(engine.scheduler.running) + sum(o.finished for o in out))
            return out

        engine.step = traced_step  # type: ignore[method-assign]
        return engine

    front = AsyncEngine(build, burst_wait=0.5)
    front.start()

    async def burst() -> None:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        queues = []
        for text in (b"one", b"two two", b"three three three"):
            queues.append(front.submit(front.engine.make_request(list(text), params)))
            await asyncio.sleep(0.05)  # well within burst_wait of the previous one
        for q in queues:
            while not (await q.get()).finished:
                pass

    asyncio.run(burst())
    assert admitted[0] == 3
    assert front.shutdown() is None

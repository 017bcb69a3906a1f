"""Fault isolation in the engine step (issue 12): a fault in one request of a running batch fails
that request alone, gives back its KV pages and state slots, and every other request produces
exactly the tokens of a run without the faulty request."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from marconi.engine import LLM, SamplingParams
from marconi.engine.engine import Engine
from marconi.engine.request import Detokenizer, Req

torch.set_num_threads(1)

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
#: distinct first bytes, so no request's cached prefix depends on whether the faulty one ran
PROMPTS = [list(f"{c} request number {i}, tell me a story".encode()) for i, c in enumerate("ABCD")]
FAULTY = list(b"Z the request that breaks " * 2)


class _FailingDetokenizer(Detokenizer):
    """A tokenizer / stop-string fault on the request's 3rd token."""

    def update(self, ids: list[int], final: bool) -> str:
        if len(ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return super().update(ids, final)


def _seed_overflow(engine: Engine, req: Req) -> None:
    # the 2^70 seed that used to fail every request in flight (validation bypassed on purpose)
    object.__setattr__(req.params, "seed", 2**70)


def _detok_fault(engine: Engine, req: Req) -> None:
    req.detok = _FailingDetokenizer(engine.tokenizer, req.params.stop)


def _state_copy_fault(engine: Engine, req: Req) -> None:
    """The decode-time checkpoint copy of this request's working state raises (vllm+ copies at
    every 32 fed tokens)."""
    memory = engine.memory
    real = memory.copy_state

    def copy_state(src: int, dst: int) -> None:
        if req.lease is not None and src == req.lease.working:
            raise RuntimeError("injected state copy fault")
        real(src, dst)

    memory.copy_state = copy_state  # type: ignore[method-assign]


FAULTS: dict[str, tuple[SamplingParams, Callable[[Engine, Req], None]]] = {
    "sampling (2^70 seed)": (SAMPLED, _seed_overflow),
    "detokenizer": (GREEDY, _detok_fault),
    "state copy": (GREEDY, _state_copy_fault),
}


def run(fault: str | None) -> tuple[list[list[int]], Req | None, Engine]:
    """The four normal requests (greedy and seeded sampling alternating) in one batch, plus
    the faulty one when ``fault`` is given; returns the normal requests' tokens."""
    llm = LLM("tiny", "vllm+", cache_memory="64MB", chunked_prefill_size=48)
    engine = llm.engine
    reqs = [engine.make_request(p, (GREEDY, SAMPLED)[i % 2]) for i, p in enumerate(PROMPTS)]
    bad = None
    if fault is not None:
        params, inject = FAULTS[fault]
        bad = engine.make_request(FAULTY, dataclasses.replace(params))  # a copy to corrupt
        inject(engine, bad)
        reqs.insert(2, bad)  # in the middle of the batch
    for r in reqs:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if bad is not None and bad.finish_reason == "error" and engine.has_unfinished():
            # failed mid-batch: it holds nothing any more, while the others still run
            assert bad.lease is None and bad not in engine.scheduler.running
    engine.check_integrity()  # deep check + every KV page and state slot back
    assert steps > 10
    return [r.output_ids for r in reqs if r is not bad], bad, engine


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    tokens, _, _ = run(None)
    assert all(len(t) == 40 for t in tokens)
    return tokens


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_in_one_request_fails_it_alone_and_others_keep_their_tokens(
    fault: str, reference: list[list[int]]
) -> None:
    tokens, bad, engine = run(fault)
    assert bad is not None
    assert bad.finish_reason == "error" and bad.error, (bad.finish_reason, bad.error)
    assert tokens == reference  # token for token
    info = engine.manager.size_info()
    assert info.kv_in_flight == 0 and info.state_in_flight == 0


def test_a_failing_forward_pass_fails_its_batch_only_and_the_engine_keeps_serving() -> None:
    llm = LLM("tiny", "marconi", cache_memory="64MB", max_running_requests=2)
    engine = llm.engine
    real = engine.runner.forward
    calls = {"n": 0}

    def forward(inputs):  # the second forward pass raises
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected forward fault")
        return real(inputs)

    engine.runner.forward = forward  # type: ignore[method-assign]
    reqs = [engine.make_request(p, GREEDY) for p in PROMPTS]  # 2 run, 2 wait
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in reqs] == ["error", "error", "length", "length"]
    engine.check_integrity()
    again = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 40

"""Fuzzed arrivals under ``srpf`` on the embedded tiny model: what the batches show went ahead of
a mid-prefill request stays within the policy's share of its uncached prompt, and reordering
never changes a token (greedy, vs no cache)."""

from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from marconi.engine import LLM, SamplingParams
from marconi.engine.schedule_policy import ShortestRemainingPrefillFirst
from marconi.engine.scheduler import ScheduledBatch

torch.set_num_threads(1)

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
SHARE = ShortestRemainingPrefillFirst.overtake_share
CHUNK = 16


@functools.cache
def engines() -> tuple[LLM, LLM]:
    srpf = LLM("tiny", "marconi", cache_memory="64MB", chunked_prefill_size=CHUNK)
    return srpf, LLM("tiny", "none", cache_memory="64MB")


def prefill_chunks(batch: ScheduledBatch) -> list[tuple[str, int]]:
    """(request id, tokens) of the batch's prefill chunks, in the batch's order."""
    return [
        (req.rid, len(inp.token_ids))
        for req, inp, fed in zip(batch.reqs, batch.inputs, batch.fed_after, strict=True)
        if fed - len(inp.token_ids) < req.prompt_len
    ]


def went_ahead(batches: list[ScheduledBatch], rid: str) -> int:
    """Prefill tokens of requests that started after ``rid`` and ran ahead of it while it was
    mid-prefill: before its chunk in a step that has one, or in a step it sat out."""
    chunks = [prefill_chunks(b) for b in batches]
    steps = [i for i, c in enumerate(chunks) if any(r == rid for r, _ in c)]
    first, last = steps[0], steps[-1]
    started = {r.rid for b in batches[: first + 1] for r in b.reqs}
    total = 0
    for step in chunks[first + 1 : last + 1]:
        for r, n in step:
            if r == rid:
                break
            if r not in started:
                total += n
    return total


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.binary(min_size=48, max_size=128),
    st.lists(
        st.tuples(st.integers(0, 8), st.binary(min_size=4, max_size=64)), min_size=1, max_size=7
    ),
)
def test_srpf_bounds_what_goes_ahead_and_keeps_tokens(
    long: bytes, others: list[tuple[int, bytes]]
) -> None:
    """A long prompt at step 0, then ``others``: (the step it arrives at, its prompt bytes)."""
    arrivals = [(0, long), *others]
    llm, plain = engines()
    engine = llm.engine
    batches: list[ScheduledBatch] = []
    schedule = engine.scheduler.schedule

    def recording() -> tuple[ScheduledBatch | None, list]:
        batch, failed = schedule()
        if batch is not None:
            batches.append(batch)
        return batch, failed

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    try:
        pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
        reqs, outputs, step = {}, {}, 0
        while pending or engine.has_unfinished():
            while pending and pending[0][1][0] <= step:
                i, (_, prompt) = pending.pop(0)
                req = engine.make_request(list(prompt), GREEDY, rid=f"r{i}")
                reqs[req.rid] = req
                engine.add_request(req)
            for out in engine.step():
                outputs[out.rid] = outputs.get(out.rid, ()) + out.token_ids
            llm.check_integrity()
            step += 1
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    assert SHARE is not None
    for rid, req in reqs.items():
        assert went_ahead(batches, rid) <= SHARE * (req.prompt_len - req.cached_tokens), rid
    want = plain.generate([list(p) for _, p in arrivals], GREEDY)
    assert outputs == {f"r{i}": w.token_ids for i, w in enumerate(want)}

"""End prefill chunks where the admission planned a state, so SGLang's ``no_buffer`` mode caches it.

In ``no_buffer`` mode SGLang hands the radix tree a Mamba state only where a prefill chunk ends
(the last chunk ends at the prompt end) and at finish. The admission plans prefill states
elsewhere too: the branch point found by speculative insertion (SGLang's
``Req.mamba_branching_seqlen``), and with the learned admission of the ``marconi`` preset one
token before the prompt end (``resend``: an identical prompt sent again resumes there) and the
last block-aligned input position. Without these hooks such a state exists only when a chunk
happens to end on it.

Two AROUND hooks, registered by the plugin, on ``PrefillAdder.add_one_req`` (a request's first
chunk) and ``PrefillAdder.add_chunked_req`` (every later chunk of a chunked request): with the
``marconi`` backend, the request is planned (``MarconiRadixCache.plan_request``: once, on its
latest match, as ``Leases.begin`` plans) and, when a planned position lies inside the tokens
this chunk would prefill, the chunk budget for this request is capped so that the chunk ends
there (the paper's split prefill, generalised: prefix, then the rest). The request continues as
SGLang's own chunked request in the next round, and the batch ends with it, as after SGLang's
own chunking (SGLang runs one chunked request at a time). ``lru`` is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ADD_ONE_REQ_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
ADD_CHUNKED_REQ_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req"


def planned_chunk_len(adder: Any, req: Any) -> int | None:
    """Tokens to prefill now so the chunk ends at the next planned state, or None (no cut)."""
    from marconi.integrations.sglang.backend import MarconiRadixCache

    cache = adder.tree_cache
    if not isinstance(cache, MarconiRadixCache):
        return None
    plan = cache.plan_request(req)
    # extra_buffer: SGLang offers tracked states, not chunk ends (the branch state is tracked
    # inside the scan), so a cut would buy nothing
    if adder.rem_chunk_tokens is None or cache.enable_mamba_extra_buffer:
        return None
    start, end = req.prefix_len, len(req.full_untruncated_fill_ids)
    stops = [p for p in plan.prefill if start < p < end]
    if not stops:
        return None
    cut = stops[0] - start
    return cut if cut < adder.rem_chunk_tokens else None


def split_prefill_at_plan(original: Callable[..., Any], adder: Any, req: Any, *args: Any,
                          **kwargs: Any) -> Any:  # fmt: skip
    """The AROUND hook of both targets."""
    cut = planned_chunk_len(adder, req)
    if cut is None:
        return original(adder, req, *args, **kwargs)
    budget = adder.rem_chunk_tokens
    adder.rem_chunk_tokens = cut
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        if adder.rem_chunk_tokens <= 0:
            # the request took its cut chunk and goes on as the chunked request: the batch ends
            # here, as it does after SGLang's own chunk (one chunked request at a time: another
            # request chunked in this batch would trip the scheduler's ``chunked_req`` assert)
            adder.rem_chunk_tokens = 0
        else:  # not admitted (or took less): the batch keeps its real budget
            adder.rem_chunk_tokens = budget - (cut - adder.rem_chunk_tokens)

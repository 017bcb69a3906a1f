"""Split a prefill exactly at the branch point, so SGLang's ``no_buffer`` mode caches its state.

In ``no_buffer`` mode SGLang hands the radix tree a Mamba state only where a prefill chunk ends
(and at finish). Marconi's main gain comes from the branch point that speculative insertion finds
(SGLang's ``Req.mamba_branching_seqlen``, set by ``match_prefix`` before scheduling): a state there
serves every later request sharing that prefix. Without this hook the branch state exists only
when a chunk happens to end on it, so purely-input reuse (shared system prompts) never hits.

``split_prefill_at_branch`` is an AROUND hook on ``PrefillAdder.add_one_req`` (registered by the
plugin): when the cache is the ``marconi`` backend and the branch point lies inside the request's
uncached tokens, the chunk budget for this request is capped so that its first chunk ends there
(the paper's split prefill: prefix, then the rest). The request continues as SGLang's own chunked
request in the next round; the rest of the batch keeps its budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ADD_ONE_REQ_TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"


def branch_chunk_len(adder: Any, req: Any) -> int | None:
    """Tokens to prefill now so the chunk ends at the branch point, or None (no split)."""
    from marconi.integrations.sglang.backend import MarconiRadixCache

    if not isinstance(adder.tree_cache, MarconiRadixCache) or adder.rem_chunk_tokens is None:
        return None
    branch = getattr(req, "mamba_branching_seqlen", None)
    if branch is None:
        return None
    cut = branch - req.prefix_len
    remaining = len(req.full_untruncated_fill_ids) - req.prefix_len
    if 0 < cut < remaining and cut < adder.rem_chunk_tokens:
        return cut
    return None


def split_prefill_at_branch(original: Callable[..., Any], adder: Any, req: Any, *args: Any,
                            **kwargs: Any) -> Any:  # fmt: skip
    cut = branch_chunk_len(adder, req)
    if cut is None:
        return original(adder, req, *args, **kwargs)
    budget = adder.rem_chunk_tokens
    adder.rem_chunk_tokens = cut
    try:
        return original(adder, req, *args, **kwargs)
    finally:  # charge what this request used against the batch's real budget
        adder.rem_chunk_tokens = budget - (cut - adder.rem_chunk_tokens)

"""Shared test helpers: real cost models from presets and a small request driver."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from marconi.cache.cost import load_cost_model
from marconi.cache.node import MatchResult
from marconi.cache.pools import MemoryBudget
from marconi.cache.prefix_cache import CacheConfig, PrefixCache

MODELS = {"hybrid": "paper-7b", "attention": "llama-3.1-8b", "ssm": "mamba2-2.7b"}


def cost_for(kind: str):
    return load_cost_model(MODELS[kind])


def make_cache(
    kind: str = "hybrid",
    *,
    tokens: int = 10_000,
    states: int = 100,
    admission: str = "marconi",
    eviction: str = "lru",
    alpha: float = 0.0,
    page_size: int = 1,
    shared: bool = True,
    **admission_args: object,
) -> PrefixCache:
    """A cache whose budget holds ``tokens`` tokens of KV plus ``states`` SSM checkpoints."""
    cost = cost_for(kind)
    kv_bytes = tokens * cost.kv_bytes_per_token
    st_bytes = states * cost.state_bytes
    budget = (
        MemoryBudget.shared(kv_bytes + st_bytes)
        if shared
        else MemoryBudget.separate(kv_bytes, st_bytes)
    )
    cfg = CacheConfig(admission, admission_args, eviction, alpha, page_size)
    return PrefixCache(cost, budget, cfg)


def toks(*values: int | Sequence[int]) -> np.ndarray:
    out: list[int] = []
    for v in values:
        out.extend(v if isinstance(v, Sequence | range) else [v])
    return np.array(out, dtype=np.int64)


@dataclass
class Running:
    """One request in flight, driven through the cache like the engine does."""

    tokens: np.ndarray
    match: MatchResult
    kv_new: np.ndarray | None
    states: dict[int, int] = field(default_factory=dict)


def start(cache: PrefixCache, tokens: np.ndarray) -> Running | None:
    """Match, lock, plan, allocate the suffix KV and the planned states. None if it cannot fit."""
    m = cache.match(tokens)
    cache.lock(m.node)
    kv_new = None
    if cache.pools.kv is not None:
        p = cache.page_size
        n_pages = -(-len(tokens) // p) - len(m.kv)
        kv_new = cache.alloc_kv(n_pages)
        if kv_new is None:
            cache.unlock(m.node)
            return None
    run = Running(tokens, m, kv_new)
    for pos in cache.plan_prefill(tokens, m):
        slot = cache.alloc_state()
        if slot is not None:
            run.states[pos] = slot
    return run


def finish(cache: PrefixCache, run: Running, output_len: int = 0) -> None:
    """Insert the sequence (input + output) with the captured and decode states; unlock."""
    seq = run.tokens
    kv = run.match.kv
    if run.kv_new is not None:
        kv = np.concatenate([kv, run.kv_new])
    for pos in cache.plan_decode(len(run.tokens) - output_len, len(seq)):
        slot = cache.alloc_state()
        if slot is not None:
            run.states[pos] = slot
    cache.insert(seq, kv, run.states)
    cache.unlock(run.match.node)


def abort(cache: PrefixCache, run: Running) -> None:
    if run.kv_new is not None:
        cache.free_kv(run.kv_new)
    for slot in run.states.values():
        cache.free_state(slot)
    cache.unlock(run.match.node)


def serve(cache: PrefixCache, tokens: np.ndarray, output_len: int = 0) -> MatchResult:
    """Serve one request start to finish (sequential replay); returns its match."""
    run = start(cache, tokens)
    assert run is not None, "request did not fit"
    finish(cache, run, output_len)
    cache.check_integrity(deep=True)
    return run.match


@pytest.fixture
def hybrid_cache() -> PrefixCache:
    return make_cache("hybrid")

"""Shared test helpers: real cost models from presets and the request lifecycle (``Leases``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from marconi.cache.cost import load_cost_model
from marconi.cache.lease import Lease, Leases
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
    match_rule: str = "last-token",
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
    cfg = CacheConfig(admission, admission_args, eviction, alpha, page_size, match_rule)
    return PrefixCache(cost, budget, cfg)


def toks(*values: int | Sequence[int]) -> np.ndarray:
    out: list[int] = []
    for v in values:
        out.extend(v if isinstance(v, Sequence | range) else [v])
    return np.array(out, dtype=np.int64)


def start(cache: PrefixCache, tokens: np.ndarray, max_fed: int | None = None) -> Lease | None:
    """``Leases.begin`` for an input of ``tokens`` (feeding ``max_fed`` tokens, default all)."""
    return Leases(cache).begin(tokens, len(tokens) if max_fed is None else max_fed)


def finish(cache: PrefixCache, lease: Lease, fed: np.ndarray) -> None:
    """Decode to ``len(fed)`` tokens (the capture points) and finish with ``fed``."""
    leases = Leases(cache)
    leases.decode(lease, len(fed))
    leases.finish(lease, fed)


def abort(cache: PrefixCache, lease: Lease) -> None:
    Leases(cache).abort(lease)


def serve(cache: PrefixCache, fed: np.ndarray, output_len: int = 0) -> Lease:
    """Serve one request start to finish: its input is ``fed`` minus the last ``output_len``
    tokens (the decoded ones it fed); returns its (finished) lease."""
    lease = Leases(cache).replay(fed[: len(fed) - output_len], fed)
    assert lease is not None, "request did not fit"
    cache.check_integrity(deep=True)
    return lease


@pytest.fixture
def hybrid_cache() -> PrefixCache:
    return make_cache("hybrid")

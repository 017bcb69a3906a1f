"""One simulation: a trace, a model's cost model, a capacity and a policy preset -> SimResult."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from marconi.cache.cost import CostModel, load_cost_model
from marconi.cache.lease import Leases
from marconi.cache.pools import MemoryBudget
from marconi.cache.prefix_cache import CacheConfig, PrefixCache
from marconi.cache.presets import get_preset, preset_config
from marconi.cache.tuning import TUNERS, AlphaTuner
from marconi.sim.latency import get_profile
from marconi.sim.metrics import SimResult
from marconi.sim.replay import Replayer
from marconi.sim.traces import Request
from marconi.units import parse_bytes

__all__ = ["SimSpec", "build_cache", "infinite_bound", "infinite_cache", "parse_bytes", "simulate"]


@dataclass(frozen=True)
class SimSpec:
    """What to simulate. ``alpha``: "auto" (tuned online by ``tuner``) or a fixed value; ignored
    by presets without FLOP-aware eviction."""

    policy: str = "marconi"
    capacity_bytes: int = 40 * 10**9
    mode: str = "sequential"  # or "concurrent"
    alpha: str | float = "auto"
    tuner: str = "shadow"
    profile: str = "a100"
    trace_name: str = "trace"
    workers: int = 0  # tuning processes (0 = one per core)
    match_rule: str = "last-token"  # what a request may resume from (``marconi.cache.lease``)


def build_cache(cost: CostModel, spec: SimSpec) -> tuple[PrefixCache, bool]:
    """The cache for ``spec`` and whether its alpha must be tuned online."""
    preset = get_preset(spec.policy)
    fixed = None if spec.alpha == "auto" else float(spec.alpha)
    config: CacheConfig = preset_config(spec.policy, alpha=fixed, match_rule=spec.match_rule)
    cache = PrefixCache(cost, MemoryBudget.shared(spec.capacity_bytes), config)
    return cache, preset.tune_alpha and fixed is None


def simulate(
    trace: Sequence[Request], cost: CostModel | str, spec: SimSpec, progress: bool = False
) -> SimResult:
    """Replay ``trace`` through a fresh cache built from ``spec``; see ``SimResult``."""
    if isinstance(cost, str):
        cost = load_cost_model(cost)
    cache, tune = build_cache(cost, spec)
    tuner: AlphaTuner | None = None
    if tune:
        tuner = TUNERS.create(spec.tuner, cache=cache, workers=spec.workers)
    rp = Replayer(cache, get_profile(spec.profile))
    start_admitted = cache.stats.states_admitted
    t0 = time.perf_counter()
    before = None if tuner is None else (lambda i, req: tuner.observe((req.input_ids, req.fed_ids)))
    run = rp.run_concurrent if spec.mode == "concurrent" else rp.run_sequential
    if spec.mode not in ("sequential", "concurrent"):
        raise ValueError(f"unknown mode {spec.mode!r}: sequential or concurrent")
    run(trace, before=before, progress=progress)
    wall = time.perf_counter() - t0
    cache.check_integrity()
    return rp.result(
        trace=spec.trace_name,
        policy=spec.policy,
        mode=spec.mode,
        capacity_bytes=spec.capacity_bytes,
        alpha=cache.alpha,
        states_admitted=cache.stats.states_admitted - start_admitted,
        wall_s=wall,
        alpha_history=[] if tuner is None else list(tuner.history),
        tuning_s=0.0 if tuner is None else tuner.tuning_s,
    )


def infinite_bound(
    trace: Sequence[Request], cost: CostModel, page_size: int = 1, match_rule: str = "last-token"
) -> float:
    """Token hit rate if every earlier prefix were reusable (unbounded cache, a state at every
    position): each request's longest common prefix (of its match key) with all earlier
    sequences."""
    return infinite_cache(trace, cost, page_size, match_rule).hit_rate


class InfiniteCache(NamedTuple):
    hit_rate: float
    unique_tokens: int  # tokens an unbounded tree ends up holding


def shared_prefixes(
    trace: Sequence[Request], cost: CostModel, page_size: int = 1, match_rule: str = "last-token"
) -> tuple[list[int], PrefixCache]:
    """Each request's longest (page-aligned) common prefix with every earlier sequence, found
    by replaying the trace through an unbounded cache with the live lifecycle; and that cache."""
    spec = SimSpec(policy="sglang+", capacity_bytes=2**62, match_rule=match_rule)
    cache, _ = build_cache(cost, spec)
    leases = Leases(cache)
    lens: list[int] = []
    for req in trace:
        lease = leases.replay(req.input_ids, req.fed_ids)
        assert lease is not None
        kv_len = lease.match.kv_len
        lens.append(kv_len - kv_len % page_size)
    return lens, cache


def infinite_cache(
    trace: Sequence[Request], cost: CostModel, page_size: int = 1, match_rule: str = "last-token"
) -> InfiniteCache:
    """``infinite_bound`` plus the size of what an unbounded cache would hold."""
    lens, cache = shared_prefixes(trace, cost, page_size, match_rule)
    total = sum(req.num_input_tokens for req in trace)
    unique = sum(len(n.key) for n in cache.tree.iter_nodes())
    return InfiniteCache(sum(lens) / total if total else 0.0, unique)

"""One simulation: a trace, a model's cost model, a capacity and a policy preset -> SimResult."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from marconi.cache.cost import CostModel, load_cost_model
from marconi.cache.pools import MemoryBudget
from marconi.cache.prefix_cache import CacheConfig, PrefixCache
from marconi.cache.presets import get_preset, preset_config
from marconi.cache.tuning import TUNERS, AlphaTuner
from marconi.sim.latency import get_profile
from marconi.sim.metrics import SimResult
from marconi.sim.replay import Replayer, replay_hits
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


def _sim_hits(cache: PrefixCache, window: Sequence[Request]) -> float:
    return float(replay_hits(cache, window))


def build_cache(cost: CostModel, spec: SimSpec) -> tuple[PrefixCache, bool]:
    """The cache for ``spec`` and whether its alpha must be tuned online."""
    preset = get_preset(spec.policy)
    fixed = None if spec.alpha == "auto" else float(spec.alpha)
    config: CacheConfig = preset_config(spec.policy, alpha=fixed)
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
        tuner = TUNERS.create(spec.tuner, cache=cache, replay=_sim_hits, workers=spec.workers)
    rp = Replayer(cache, get_profile(spec.profile))
    start_admitted = cache.stats.states_admitted
    t0 = time.perf_counter()
    before = None if tuner is None else (lambda i, req: tuner.observe(req))
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


def infinite_bound(trace: Sequence[Request], cost: CostModel, page_size: int = 1) -> float:
    """Token hit rate if every earlier prefix were reusable (unbounded cache, a state at every
    position): each input's longest common prefix with all earlier sequences."""
    return infinite_cache(trace, cost, page_size).hit_rate


class InfiniteCache(NamedTuple):
    hit_rate: float
    unique_tokens: int  # tokens an unbounded tree ends up holding


def infinite_cache(trace: Sequence[Request], cost: CostModel, page_size: int = 1) -> InfiniteCache:
    """``infinite_bound`` plus the size of what an unbounded cache would hold."""
    spec = SimSpec(policy="sglang+", capacity_bytes=2**62)
    cache, _ = build_cache(cost, spec)
    hits = total = 0
    for req in trace:
        m = cache.match(req.input_ids)
        hits += m.cached_len - m.cached_len % page_size
        total += req.num_input_tokens
        out = req.output_ids
        seq = np.concatenate([req.input_ids, out[:-1]]) if len(out) > 1 else req.input_ids
        if cache.pools.kv is not None:
            kv = cache.alloc_kv(len(seq) - len(m.kv))
            assert kv is not None
            cache.insert(seq, np.concatenate([m.kv, kv]))
        else:
            cache.insert(seq, None)
    unique = sum(len(n.key) for n in cache.tree.iter_nodes())
    return InfiniteCache(hits / total if total else 0.0, unique)

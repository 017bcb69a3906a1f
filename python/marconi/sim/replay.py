"""Trace replay through the real cache core (byte counts, no tensors).

Each request is driven through ``PrefixCache`` exactly as the engine drives it: match, lock,
speculative insertion + admission plan, allocate the request's KV and checkpoint slots (evicting
first), then on finish insert the tokens fed to the model (input + output[:-1]) with the
captured states and unlock. Sequential mode is the paper's (each request finishes before the
next starts); concurrent mode overlaps requests by arrival time and a modeled duration, so
in-flight requests pin their prefix and hold their memory, as in a real server.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from marconi.sim.latency import LatencyProfile
from marconi.sim.metrics import RequestRecord, SimResult, by_length, percentile

if TYPE_CHECKING:
    from marconi.cache.node import MatchResult
    from marconi.cache.prefix_cache import PrefixCache
    from marconi.sim.traces import Request


@dataclass
class Flight:
    """A request in flight: its locked match and the memory it holds."""

    seq: np.ndarray  # tokens that will have been fed to the model: input + output[:-1]
    match: MatchResult
    kv: np.ndarray | None  # all KV slots of seq (matched prefix + own), None if uncached
    states: dict[int, int] = field(default_factory=dict)
    record: RequestRecord | None = None


class Replayer:
    """Serves requests against one cache and records what each saw."""

    def __init__(self, cache: PrefixCache, profile: LatencyProfile | None = None) -> None:
        self.cache = cache
        self.profile = profile
        self.records: list[RequestRecord] = []
        self.reused_states: set[tuple[int, int]] = set()
        self.uncached = 0
        self.hit_tokens = 0  # running total (tuners read it)

    # -------------------------------------------------------------- one request
    def begin(self, req: Request) -> Flight:
        cache = self.cache
        inp = req.input_ids
        m = cache.match(inp)
        cache.lock(m.node)
        if m.usable_len and m.state is not None:
            self.reused_states.add((m.node.id, m.state))
        out = req.output_ids
        seq = np.concatenate([inp, out[:-1]]) if len(out) > 1 else inp
        flight = Flight(seq, m, None, record=self._record(req, m.usable_len))
        if cache.pools.kv is not None:
            p = cache.page_size
            own = cache.alloc_kv(-(-len(seq) // p) - len(m.kv))
            if own is None:  # larger than the whole budget: served without caching
                self.uncached += 1
                return flight
            flight.kv = np.concatenate([m.kv, own])
        elif cache.pools.state is None:
            return flight
        if cache.pools.state is not None:
            positions = cache.plan_prefill(inp, m) + cache.plan_decode(len(inp), len(seq))
            flight.states = dict(zip(positions, cache.alloc_states(len(positions)), strict=False))
        return flight

    def end(self, flight: Flight) -> None:
        cache = self.cache
        if flight.kv is not None or (cache.pools.kv is None and flight.states):
            cache.insert(flight.seq, flight.kv, flight.states)
        cache.unlock(flight.match.node)
        if flight.record is not None:
            self.records.append(flight.record)

    def serve(self, req: Request) -> RequestRecord:
        """Sequential: begin and end one request."""
        flight = self.begin(req)
        self.end(flight)
        assert flight.record is not None
        return flight.record

    def _record(self, req: Request, hit: int) -> RequestRecord:
        cost = self.cache.cost
        total = float(cost.prefill_flops(req.num_input_tokens, 0))
        saved = float(cost.prefill_flops(hit, 0)) if hit else 0.0
        ttft = 0.0
        if self.profile is not None:
            ttft = self.profile.prefill_s(total - saved)
        self.hit_tokens += hit
        return RequestRecord(req.arrival, req.num_input_tokens, hit, total, saved, ttft)

    def result(self, **fields: object) -> SimResult:
        """A ``SimResult`` of the requests served so far; ``fields`` gives the descriptive ones
        (trace, policy, mode, capacity_bytes, alpha, wall_s, ...)."""
        recs = self.records
        ttfts = [r.ttft_s for r in recs]
        return SimResult(
            model=self.cache.cost.name,  # type: ignore[attr-defined]
            requests=len(recs),
            input_tokens=sum(r.input_len for r in recs),
            hit_tokens=sum(r.hit_len for r in recs),
            hit_requests=sum(1 for r in recs if r.hit_len),
            flops_total=sum(r.flops_total for r in recs),
            flops_saved_abs=sum(r.flops_saved for r in recs),
            states_reused=len(self.reused_states),
            peak_bytes=self.cache.pools.peak_bytes,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p95_s=percentile(ttfts, 95),
            by_length=by_length(recs),
            uncached_requests=self.uncached,
            **fields,  # type: ignore[arg-type]
        )

    # -------------------------------------------------------------- whole traces
    def run_sequential(
        self,
        trace: Iterable[Request],
        before: Callable[[int, Request], None] | None = None,
        progress: bool = False,
    ) -> None:
        """The paper's replay: in arrival order, each request finishes before the next."""
        items = list(trace)
        for i, req in enumerate(tqdm(items, disable=not progress, unit="req", leave=False)):
            if before is not None:
                before(i, req)
            self.serve(req)

    def run_concurrent(
        self,
        trace: Iterable[Request],
        before: Callable[[int, Request], None] | None = None,
        progress: bool = False,
    ) -> None:
        """Overlapping requests: each starts at its arrival and finishes after its modeled
        prefill (uncached part) + decode time; in flight it pins its prefix and holds memory."""
        if self.profile is None:
            raise ValueError("concurrent replay needs a latency profile")
        items = list(trace)
        finishing: list[tuple[float, int, Flight]] = []
        bar = tqdm(total=len(items), disable=not progress, unit="req", leave=False)
        for i, req in enumerate(items):
            while finishing and finishing[0][0] <= req.arrival:
                self.end(heapq.heappop(finishing)[2])
                bar.update()
            if before is not None:
                before(i, req)
            flight = self.begin(req)
            assert flight.record is not None
            duration = flight.record.ttft_s + self.profile.decode_s_per_token * max(
                req.num_output_tokens - 1, 0
            )
            heapq.heappush(finishing, (req.arrival + duration, i, flight))
        while finishing:
            self.end(heapq.heappop(finishing)[2])
            bar.update()
        bar.close()


def replay_fed(cache: PrefixCache, items: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    """Hit tokens of replaying ``(input ids, fed tokens)`` pairs, as an engine records finished
    requests (fed = input + output[:-1]); the shadow-cache tuner's replay in the engine."""
    from marconi.sim.traces import Request

    # the replayer feeds input + output[:-1]: a placeholder last output token gives back ``fed``
    reqs = [
        Request("", 0, 0.0, inp, np.append(fed[len(inp) :], 0).astype(np.int64))
        for inp, fed in items
    ]
    return replay_hits(cache, reqs)


def replay_hits(cache: PrefixCache, trace: Iterable[Request]) -> int:
    """Hit tokens of a sequential replay (used by the alpha tuners on cache snapshots)."""
    rp = Replayer(cache)
    rp.run_sequential(trace)
    return rp.hit_tokens


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t

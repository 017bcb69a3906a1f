"""Trace replay through the real cache core (byte counts, no tensors).

Each request runs the engine's lifecycle, ``marconi.cache.lease.Leases``: ``begin`` (match rule,
lock, KV for every token it feeds, a working state, the planned prefill captures), the decode
captures, then ``finish`` (insert the fed tokens, input + output[:-1], unlock). Sequential mode is
the paper's (each request finishes before the next starts); concurrent mode overlaps requests by
arrival time and a modeled duration, so in-flight requests pin their prefix and hold their
memory, as in a real server. A request that does not fit (``begin`` is None: larger than the
budget, or, concurrently, than what in-flight requests leave) is served without the cache.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from marconi.cache.lease import Lease, Leases
from marconi.sim.latency import LatencyProfile
from marconi.sim.metrics import RequestRecord, SimResult, by_length, percentile

if TYPE_CHECKING:
    from marconi.cache.prefix_cache import PrefixCache
    from marconi.sim.traces import Request


@dataclass
class Flight:
    """A request in flight: its lease (None: served without the cache) and its record."""

    req: Request
    lease: Lease | None
    record: RequestRecord


class Replayer:
    """Serves requests against one cache and records what each saw."""

    def __init__(self, cache: PrefixCache, profile: LatencyProfile | None = None) -> None:
        self.cache = cache
        self.leases = Leases(cache)
        self.profile = profile
        self.records: list[RequestRecord] = []
        self.reused_states: set[tuple[int, int]] = set()
        self.uncached = 0
        self.hit_tokens = 0  # running total

    # -------------------------------------------------------------- one request
    def begin(self, req: Request) -> Flight:
        lease = self.leases.begin(req.input_ids, req.num_fed_tokens)
        if lease is None:
            self.uncached += 1
        elif lease.prefix_len and lease.match.state is not None:
            self.reused_states.add((lease.match.node.id, lease.match.state))
        return Flight(req, lease, self._record(req, 0 if lease is None else lease.prefix_len))

    def advance(self, flight: Flight, fed: int) -> None:
        """The request decoded until ``fed`` tokens are fed (its captures so far)."""
        if flight.lease is not None:
            self.leases.decode(flight.lease, fed)

    def end(self, flight: Flight) -> None:
        """The request decoded and finished (``Leases.decode`` + ``finish``)."""
        if flight.lease is not None:
            fed = flight.req.fed_ids
            self.leases.decode(flight.lease, len(fed))
            self.leases.finish(flight.lease, fed)
        self.records.append(flight.record)

    def abort(self, flight: Flight) -> None:
        """The request was cancelled: it gives everything back and is not recorded."""
        if flight.lease is not None:
            self.leases.abort(flight.lease)
        self.hit_tokens -= flight.record.hit_len

    def serve(self, req: Request) -> RequestRecord:
        """Sequential: begin and end one request."""
        flight = self.begin(req)
        self.end(flight)
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
            duration = flight.record.ttft_s + self.profile.decode_s_per_token * max(
                req.num_output_tokens - 1, 0
            )
            heapq.heappush(finishing, (req.arrival + duration, i, flight))
        while finishing:
            self.end(heapq.heappop(finishing)[2])
            bar.update()
        bar.close()

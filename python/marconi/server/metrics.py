"""Prometheus metrics (``GET /metrics``): request latencies observed by the server, and cache and
engine counters read from an ``EngineStats`` snapshot taken on the engine thread per scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

if TYPE_CHECKING:
    from marconi.engine.engine import EngineStats

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60)
_ITL = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)


class _EngineCollector:
    """Yields the engine/cache metrics of the latest snapshot."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        counters = {
            "prompt_tokens": ("prompt tokens of finished requests", s.prompt_tokens),
            "cached_tokens": ("prompt tokens served from the prefix cache", s.cached_tokens),
            "generation_tokens": ("tokens generated", s.generated_tokens),
            "cache_evicted_nodes": ("radix-tree nodes evicted", s.cache.evicted_nodes),
            "cache_evicted_kv_slots": ("KV slots (pages) evicted", s.cache.evicted_kv_slots),
            "cache_evicted_states": ("SSM states evicted", s.cache.evicted_states),
            "cache_states_admitted": ("SSM checkpoints admitted", s.cache.states_admitted),
            "cache_states_declined": ("SSM checkpoints declined", s.cache.states_declined),
            "engine_steps": ("engine steps (forward passes)", s.steps),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"marconi_{name}", doc, value=value)
        phases = CounterMetricFamily(
            "marconi_engine_step_seconds", "engine thread time by step phase", labels=["phase"]
        )
        for phase, seconds in s.step_times._asdict().items():
            phases.add_metric([phase], seconds)
        yield phases
        z = s.size
        gauges = {
            "num_requests_running": ("requests admitted", s.running),
            "num_requests_waiting": ("requests queued", s.waiting),
            "cache_hit_rate": ("cached / prompt tokens of finished requests", s.hit_rate),
            "kv_bytes_in_use": ("KV bytes allocated (cache + requests)", s.kv_bytes_in_use),
            "state_bytes_in_use": ("SSM state bytes allocated", s.state_bytes_in_use),
            "cache_capacity_bytes": ("KV + state byte budget", z.capacity_bytes),
            "cache_nodes": ("radix-tree nodes", z.nodes),
            "kv_slots_cached": ("KV slots (pages) held by the tree", z.kv_cached + z.kv_locked),
            "states_cached": ("SSM states held by the tree", z.state_cached + z.state_locked),
            "kv_slots_in_flight": ("KV slots (pages) held by requests", z.kv_in_flight),
            "states_in_flight": ("state slots held by requests", z.state_in_flight),
        }
        if s.alpha is not None:
            gauges["eviction_alpha"] = ("FLOP-aware eviction weight", s.alpha)
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"marconi_{name}", doc, value=value)


class ServerMetrics:
    """One registry per server (so tests can run several in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "marconi_time_to_first_token_seconds", "TTFT", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "marconi_inter_token_latency_seconds", "time between tokens", buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "marconi_e2e_request_latency_seconds", "request latency", buckets=_LATENCY, registry=r
        )
        self.requests = Counter(
            "marconi_requests", "finished requests", ["finish_reason"], registry=r
        )
        self.in_progress = Gauge("marconi_http_requests_in_progress", "open requests", registry=r)
        self.rejected = Counter(
            "marconi_requests_rejected",
            "requests refused with 503 before queueing",
            ["reason"],
            registry=r,
        )
        self.rejected.labels("queue_full")  # exported (as 0) from the start
        self.timed_out = Counter(
            "marconi_requests_timed_out",
            "requests that waited past --queue-timeout (503)",
            registry=r,
        )
        self._engine = _EngineCollector()
        r.register(self._engine)

    def started(self) -> None:
        self.in_progress.inc()

    def finished(self, reason: str | None, latency: float | None) -> None:
        self.in_progress.dec()
        self.requests.labels(reason or "unknown").inc()
        if latency is not None:
            self.e2e.observe(latency)

    def render(self, stats: EngineStats) -> bytes:
        self._engine.stats = stats
        return generate_latest(self.registry)

"""Replay metrics: hit rates, FLOPs saved, state reuse, peak bytes, modeled TTFT."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

#: input-length buckets (tokens) for "hit rate by input length" (the paper's Figure 10)
LENGTH_BUCKETS = (0, 1024, 4096, 16384, 65536)


def bucket_label(lo: int, hi: int | None) -> str:
    def k(n: int) -> str:
        return f"{n // 1024}K" if n else "0"

    return f"{k(lo)}+" if hi is None else f"{k(lo)}-{k(hi)}"


@dataclass
class RequestRecord:
    """What one request saw."""

    arrival: float
    input_len: int
    hit_len: int
    flops_total: float
    flops_saved: float
    ttft_s: float = 0.0


@dataclass
class SimResult:
    """One replay's results (``to_dict`` is the ``marconi-sim run --json`` object)."""

    trace: str
    model: str
    policy: str
    mode: str
    capacity_bytes: int
    alpha: float | None
    requests: int
    input_tokens: int
    hit_tokens: int
    hit_requests: int
    flops_total: float
    flops_saved_abs: float
    states_admitted: int
    states_reused: int
    peak_bytes: int
    wall_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    by_length: dict[str, float] = field(default_factory=dict)
    alpha_history: list[tuple[int, float]] = field(default_factory=list)
    uncached_requests: int = 0  # did not fit in the cache at all (served without caching)
    tuning_s: float = 0.0  # wall time spent in alpha tuning (included in wall_s)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0

    @property
    def flops_saved(self) -> float:
        return self.flops_saved_abs / self.flops_total if self.flops_total else 0.0

    @property
    def state_reuse(self) -> float:
        return self.states_reused / self.states_admitted if self.states_admitted else 0.0

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out.update(
            token_hit_rate=self.token_hit_rate,
            request_hit_rate=self.request_hit_rate,
            flops_saved=self.flops_saved,
            state_reuse=self.state_reuse,
        )
        out.pop("flops_saved_abs")
        return out

    def summary(self) -> str:
        """A readable multi-line summary for terminals."""
        lines = [
            f"trace {self.trace}  model {self.model}  policy {self.policy}  mode {self.mode}",
            f"capacity {self.capacity_bytes / 1e9:.2f} GB  peak {self.peak_bytes / 1e9:.2f} GB"
            + ("" if self.alpha is None else f"  alpha {self.alpha:g}"),
            f"requests {self.requests}  input tokens {self.input_tokens:,}",
            f"token hit rate   {100 * self.token_hit_rate:6.2f} %",
            f"request hit rate {100 * self.request_hit_rate:6.2f} %",
            f"FLOPs saved      {100 * self.flops_saved:6.2f} %",
            f"states admitted  {self.states_admitted:,}  reused {100 * self.state_reuse:.1f} %",
            f"modeled TTFT     p50 {1e3 * self.ttft_p50_s:.1f} ms"
            f"  p95 {1e3 * self.ttft_p95_s:.1f} ms",
            "hit rate by input length: "
            + "  ".join(f"{k} {100 * v:.1f}%" for k, v in self.by_length.items()),
            f"replay wall time {self.wall_s:.2f} s",
        ]
        return "\n".join(lines)


def by_length(records: list[RequestRecord]) -> dict[str, float]:
    """Token hit rate per input-length bucket (only non-empty buckets)."""
    out: dict[str, float] = {}
    edges = (*LENGTH_BUCKETS, None)
    for lo, hi in itertools.pairwise(edges):
        sel = [r for r in records if r.input_len >= lo and (hi is None or r.input_len < hi)]
        total = sum(r.input_len for r in sel)
        if total:
            out[bucket_label(lo, hi)] = sum(r.hit_len for r in sel) / total
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0

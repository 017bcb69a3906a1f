"""Latency profiles: modeled prefill/decode time from FLOPs (for modeled TTFT and for the
concurrent replay's request durations).

A profile is ``time = overhead + flops / effective_flops_per_s``. The GPU profiles use public
peak dense BF16 numbers at an assumed 45 % model FLOPs utilisation for prefill; decode is
memory-bound and modeled per token. ``cpu-tiny`` is measured on our CPU engine (see
docs/performance_log.md: ~530 prefill tok/s for the 29M-parameter tiny model, ~31 ms/token decode).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyProfile:
    name: str
    prefill_flops_per_s: float
    prefill_overhead_s: float
    decode_s_per_token: float
    source: str

    def prefill_s(self, flops: float) -> float:
        return self.prefill_overhead_s + flops / self.prefill_flops_per_s


PROFILES: dict[str, LatencyProfile] = {
    p.name: p
    for p in (
        LatencyProfile("a100", 312e12 * 0.45, 0.010, 0.020, "A100 SXM peak BF16 312 TFLOP/s"),
        LatencyProfile("h100", 989e12 * 0.45, 0.008, 0.012, "H100 SXM peak BF16 989 TFLOP/s"),
        LatencyProfile(
            "cpu-tiny", 3.1e10, 0.005, 0.031, "measured: marconi CPU engine, tiny model, 1 thread"
        ),
    )
}


def get_profile(name: str) -> LatencyProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown latency profile {name!r}; choose {', '.join(PROFILES)}"
        ) from None

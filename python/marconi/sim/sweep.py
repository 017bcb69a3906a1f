"""Sweeps: policies x capacities x traces, as rows for CSV files, tables and plots."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from marconi.cache.cost import CostModel, load_cost_model
from marconi.sim.metrics import SimResult
from marconi.sim.simulate import SimSpec, infinite_bound, simulate
from marconi.sim.traces import Request, load_trace

CSV_FIELDS = (
    "trace",
    "model",
    "policy",
    "label",
    "capacity_bytes",
    "alpha",
    "token_hit_rate",
    "request_hit_rate",
    "flops_saved",
    "states_admitted",
    "state_reuse",
    "peak_bytes",
    "ttft_p50_s",
    "ttft_p95_s",
    "wall_s",
    "by_length",
)


@dataclass(frozen=True)
class Variant:
    """One column of a sweep: a preset with its alpha setting, under a display label."""

    label: str
    policy: str
    alpha: str | float = "auto"
    tuner: str = "shadow"


DEFAULT_VARIANTS = (
    Variant("vllm+", "vllm+"),
    Variant("sglang+", "sglang+"),
    Variant("marconi-paper (paper tuning)", "marconi-paper", tuner="paper"),
    Variant("marconi-paper (our tuning)", "marconi-paper", tuner="shadow"),
    Variant("marconi", "marconi"),
    Variant("sglang-0.5", "sglang-0.5"),
    Variant("vllm-0.32", "vllm-0.32"),
)


@dataclass(frozen=True)
class Row:
    label: str
    result: SimResult

    def as_csv(self) -> dict[str, object]:
        d = self.result.to_dict()
        d["label"] = self.label
        return {k: d.get(k) for k in CSV_FIELDS}


def run_sweep(
    traces: dict[str, Sequence[Request]],
    cost: CostModel | str,
    capacities: Sequence[int],
    variants: Iterable[Variant] = DEFAULT_VARIANTS,
    base: SimSpec | None = None,
    progress: bool = True,
) -> list[Row]:
    """Every variant on every trace at every capacity (sequential replays)."""
    if isinstance(cost, str):
        cost = load_cost_model(cost)
    base = base or SimSpec()
    variants = list(variants)
    jobs = [(t, c, v) for t in traces for c in capacities for v in variants]
    rows = []
    for name, cap, var in tqdm(jobs, disable=not progress, unit="sim"):
        spec = replace(
            base,
            policy=var.policy,
            alpha=var.alpha,
            tuner=var.tuner,
            capacity_bytes=cap,
            trace_name=name,
        )
        rows.append(Row(var.label, simulate(traces[name], cost, spec)))
    return rows


def bounds(traces: dict[str, Sequence[Request]], cost: CostModel) -> dict[str, float]:
    """Infinite-cache token hit rate per trace."""
    return {name: infinite_bound(tr, cost) for name, tr in traces.items()}


def write_csv(rows: Sequence[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(r.as_csv())


def load_traces(specs: Sequence[str], **kw: object) -> dict[str, Sequence[Request]]:
    return {s: load_trace(s, **kw.get(s, {})) for s in specs}  # type: ignore[arg-type]

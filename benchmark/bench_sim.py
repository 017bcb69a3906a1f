"""Regenerate docs/results.md: hit-rate tables on the shared traces, replay throughput, and
alpha-tuning time.

    .venv/bin/python benchmark/bench_sim.py --out docs/results.md [--quick]

Capacities are fractions of each trace's footprint for the model (the KV of every distinct token
plus one state per request), so "low / moderate / high" contention means the same on every trace
and model. Everything is measured in this one run, on this machine.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from marconi.cache.cost import CostModel, load_cost_model
from marconi.sim.metrics import SimResult
from marconi.sim.simulate import SimSpec, infinite_cache, simulate
from marconi.sim.traces import Request, load_trace
from tqdm import tqdm

FIXED_ALPHAS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
FRACTIONS = (0.05, 0.15, 0.4)  # of the footprint: high, moderate, low contention
TRACES = {  # name -> loader arguments (scaled to keep the whole run within ~20 minutes)
    "sharegpt": {"num_sessions": 300},
    "swe": {"num_sessions": 40},
    "mooncake": {"limit": 3000},
}
MODELS = ("paper-7b", "jamba-1.5-mini")
COLUMNS = (
    "vllm+",
    "sglang+",
    "marconi (paper tuning)",
    "marconi (our tuning)",
    "best fixed alpha",
    "sglang-0.5",
    "vllm-0.32",
    "oracle",
    "infinite",
)


@dataclass
class Cell:
    values: dict[str, float]
    best_alpha: float
    our_alpha: float
    paper_alpha: float


def _round_gb(nbytes: float) -> int:
    gb = nbytes / 1e9
    digits = max(0, 1 - int(f"{gb:e}".split("e")[1]))
    return int(round(gb, digits) * 1e9) or 10**9


def _oracle(trace: Sequence[Request], cost: CostModel, cap: int) -> float | None:
    try:
        from marconi.sim.oracle import simulate_oracle
    except ImportError:
        return None
    return simulate_oracle(trace, cost, cap).token_hit_rate


def run_cell(trace: Sequence[Request], cost: CostModel, cap: int, name: str, inf: float) -> Cell:
    def sim(policy: str, alpha: str | float = "auto", tuner: str = "shadow") -> SimResult:
        spec = SimSpec(policy, cap, alpha=alpha, tuner=tuner, trace_name=name)
        return simulate(trace, cost, spec)

    fixed = {a: sim("marconi", a).token_hit_rate for a in FIXED_ALPHAS}
    best_alpha = max(fixed, key=lambda a: (fixed[a], -a))
    ours, paper = sim("marconi", tuner="shadow"), sim("marconi", tuner="paper")
    values = {
        "vllm+": sim("vllm+").token_hit_rate,
        "sglang+": sim("sglang+").token_hit_rate,
        "marconi (paper tuning)": paper.token_hit_rate,
        "marconi (our tuning)": ours.token_hit_rate,
        "best fixed alpha": fixed[best_alpha],
        "sglang-0.5": sim("sglang-0.5").token_hit_rate,
        "vllm-0.32": sim("vllm-0.32").token_hit_rate,
        "infinite": inf,
    }
    oracle = _oracle(trace, cost, cap)
    if oracle is not None:
        values["oracle"] = oracle
    return Cell(values, best_alpha, float(ours.alpha or 0.0), float(paper.alpha or 0.0))


def results_tables(quick: bool) -> list[str]:
    lines: list[str] = []
    traces = {k: dict(v) for k, v in TRACES.items()}
    if quick:
        traces = {"sharegpt": {"num_sessions": 60}}
    for tname, kw in traces.items():
        trace = load_trace(tname, **kw)
        ntok = sum(r.num_input_tokens for r in trace)
        for mname in MODELS:
            cost = load_cost_model(mname)
            inf = infinite_cache(trace, cost)
            foot = inf.unique_tokens * cost.kv_bytes_per_token + len(trace) * cost.state_bytes
            caps = [_round_gb(f * foot) for f in FRACTIONS]
            lines += [
                f"### {tname} ({kw}; {len(trace)} requests, {ntok:,} input tokens) — {mname}",
                "",
                "Token hit rate (%). `alpha` columns: best fixed / ours (final) / paper's.",
                "",
                "| capacity | " + " | ".join(COLUMNS) + " | alpha best/ours/paper |",
                "|---" * (len(COLUMNS) + 2) + "|",
            ]
            for cap in tqdm(caps, desc=f"{tname}/{mname}", leave=False):
                cell = run_cell(trace, cost, cap, tname, inf.hit_rate)
                vals = [
                    f"{100 * cell.values[c]:.2f}" if c in cell.values else "n/a" for c in COLUMNS
                ]
                alphas = f"{cell.best_alpha:g} / {cell.our_alpha:g} / {cell.paper_alpha:g}"
                lines.append(f"| {cap / 1e9:g} GB | " + " | ".join(vals) + f" | {alphas} |")
            lines.append("")
    return lines


def throughput(quick: bool) -> list[str]:
    kw = {"limit": 2000} if quick else {}
    t = time.perf_counter()
    trace = load_trace("mooncake", **kw)
    load_s = time.perf_counter() - t
    ntok = sum(r.num_input_tokens for r in trace)
    lines = [
        f"Mooncake conversation trace ({len(trace):,} requests, {ntok / 1e6:.1f}M input tokens;"
        f" load {load_s:.1f} s), paper-7b, 200 GB, sequential, one process:",
        "",
        "| policy | wall s | requests/s | input tokens/s | token hit rate |",
        "|---|---|---|---|---|",
    ]
    for policy, alpha in (("marconi", 0.0), ("sglang+", "auto"), ("marconi", "auto")):
        res = simulate(trace, "paper-7b", SimSpec(policy, 200 * 10**9, alpha=alpha, workers=1))
        label = f"{policy} (alpha {alpha})"
        lines.append(
            f"| {label} | {res.wall_s:.1f} | {res.requests / res.wall_s:,.0f} |"
            f" {res.input_tokens / res.wall_s / 1e6:.1f}M | {100 * res.token_hit_rate:.2f} |"
        )
    return [*lines, ""]


def tuning_speed(quick: bool) -> list[str]:
    trace = load_trace("swe", num_sessions=20 if quick else 100)
    ntok = sum(r.num_input_tokens for r in trace)
    lines = [
        f"SWE agent sessions ({len(trace):,} requests, {ntok / 1e6:.1f}M input tokens),"
        " paper-7b, 40 GB (the reference simulator's 902 s setting), 2 processes:",
        "",
        "| tuner | tuning s | whole replay s | chosen alpha | token hit rate |",
        "|---|---|---|---|---|",
    ]
    for tuner in ("paper", "shadow"):
        res = simulate(trace, "paper-7b", SimSpec("marconi", 40 * 10**9, tuner=tuner))
        lines.append(
            f"| {tuner} | {res.tuning_s:.1f} | {res.wall_s:.1f} | {res.alpha} |"
            f" {100 * res.token_hit_rate:.2f} |"
        )
    return [*lines, ""]


NOTES = """\
## Reading the tables

- ShareGPT and SWE (multi-turn chat and agent sessions, outputs recorded): marconi >= sglang+ >>
  vllm+ at every capacity, with the largest gains under contention; our (shadow-cache) tuning is
  within 1 point of the best fixed alpha in hindsight and never below sglang+ (LRU).
- vllm+ (a state every 32 tokens) fills the budget with states nobody reuses: it is far below
  everything else until the cache holds the whole working set.
- Mooncake is the exception: vllm-0.32 and sglang-0.5 beat marconi = sglang+. The trace records
  no output tokens (our loader gives each request unique synthetic outputs) and its prefixes are
  whole 512-token blocks: turn k+1 repeats turn k's *input* blocks but not its output, so the
  state after the last decoded token, where Marconi expects the conversation to continue, is never
  reused, and the shared prefix ends at turn k's last full input block, where only policies that
  checkpoint block-aligned input positions have a state. The diagnosis below measures it: adding
  that one position to Marconi's admission recovers the gap. On real traffic the next turn
  extends input + output, which the ShareGPT and SWE rows show.
- Tuning time: the public reference simulator needed 902 s to tune one 40 GB SWE-like setting on
  2 cores (../shared/docs/MISSION.md); the "tuning s" column above is ours on that setting, the
  shadow tuner's figure covering the whole replay (it never stops adapting).
- Full-trace replay: one policy replays all of Mooncake in seconds on one core; the shadow tuner
  multiplies the work by its grid size (6 shadow caches).

### Counting rules (issue 11) and what they moved

Every replay runs the engine's lifecycle (`marconi.cache.lease.Leases`, checked against the
engine step by step in `test/cache/test_lifecycle.py`): a request resumes from a prefix of its
input minus the last token (SGLang's and our engine's rule; `--match-rule full` is the paper's,
it changes none of these tables: in chat and agent traces the next prompt always extends past
the earlier fed tokens), holds a working state slot while in flight, plans its branch point on
the tree as matched, and a request that does not fit is served without the cache and counts no
hit. Bytes come from the layer specs, which count the conv state as runtimes keep it
(d_conv - 1 columns; paper-7b 51,806,208 B per state instead of 52,297,728; Jamba-1.5-Mini
16,056,320 instead of 16,515,072). Against the previous run of this file:

- vllm+ fell at low and moderate capacity on SWE (paper-7b 5.72 -> 2.84, 20.47 -> 13.94,
  52.76 -> 49.94; Jamba 5.39 -> 2.71, 18.02 -> 12.87): the old replayer counted the matched
  prefix as a hit for requests it then served without the cache. Those are requests whose own
  pinned path holds vllm+'s every-32 states, which LRU cannot evict from inner nodes, so their
  KV never fits (161 of 1331 requests at 6.2 GB). Match rule and conv columns change nothing here
  (measured: 2.84 with either rule and either conv count).
- SWE capacities moved (19 -> 18, 50 -> 49, 1.8 -> 1.7, 5.3 -> 5.2 GB): they are fractions of a
  footprint that counts one state per request, now smaller. The Jamba 1.7 GB row is lower than
  the old 1.8 GB row because of that: at 1.8 GB with the old conv count the new lifecycle gives
  91.87 with alpha 8, the old figure exactly; at 1.7 GB it gives 89.44.
- Elsewhere cells moved by at most about 1.5 points, from the smaller states (more fit in the same
  bytes: sharegpt paper-7b 4.8 GB sglang+ 51.83 -> 51.90, the same with the old conv count) and
  from the tuners' replays now counting like the live cache (their chosen alphas changed in five
  high-contention cells).
"""


def mooncake_diagnosis(quick: bool) -> list[str]:
    """Marconi's admission plus the last 512-aligned input position, on the Mooncake slice."""
    from marconi.cache.admission import ADMISSION_POLICIES, MarconiAdmission, _last_multiple
    from marconi.cache.prefix_cache import CacheConfig
    from marconi.cache.presets import PRESETS, CachePreset

    class WithBlockEnd(MarconiAdmission):
        name = "marconi+block-end"

        def prefill_positions(self, ctx):  # type: ignore[no-untyped-def]
            block = _last_multiple(512, ctx.usable_len, ctx.input_len)
            return tuple(sorted(set(self._branch(ctx) + block)))

    if WithBlockEnd.name not in ADMISSION_POLICIES:
        ADMISSION_POLICIES.register(WithBlockEnd.name)(WithBlockEnd)
    cfg = CacheConfig(WithBlockEnd.name, {}, "flop-aware")
    PRESETS[WithBlockEnd.name] = CachePreset(WithBlockEnd.name, cfg, False, "diagnosis only")
    trace = load_trace("mooncake", limit=500 if quick else 3000)
    lines = [
        f"Mooncake, first {len(trace)} requests, paper-7b, 305 GB, alpha 0 (diagnosis only):",
        "",
        "| policy | token hit rate | states admitted |",
        "|---|---|---|",
    ]
    for policy in ("sglang+", "marconi", WithBlockEnd.name, "vllm-0.32"):
        res = simulate(trace, "paper-7b", SimSpec(policy, 305 * 10**9, alpha=0.0))
        lines.append(f"| {policy} | {100 * res.token_hit_rate:.2f} | {res.states_admitted} |")
    del PRESETS[WithBlockEnd.name]
    return [*lines, ""]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/results.md"))
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    body = [
        "# Simulator results",
        "",
        "Generated by `make bench-sim` (`benchmark/bench_sim.py`); every number below comes from"
        " that one run. Sequential replay (the paper's mode), shared KV + state budget.",
        f"Machine: {platform.processor() or platform.machine()}, Python {sys.version.split()[0]}.",
        "",
        "## Replay throughput",
        "",
        *throughput(args.quick),
        "## Alpha tuning time",
        "",
        *tuning_speed(args.quick),
        "## Hit rates",
        "",
        *results_tables(args.quick),
        NOTES,
        *mooncake_diagnosis(args.quick),
    ]
    body.append(f"Total benchmark time: {time.perf_counter() - t0:.0f} s.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(body) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``marconi-sim``: replay traces through the cache core and compare policies.

marconi-sim run --trace sharegpt --model paper-7b --capacity 40GB --policy marconi [--json]
marconi-sim sweep --trace mooncake --trace sharegpt --capacity 20GB --capacity 80GB --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from marconi.cache.cost import list_presets, load_cost_model
from marconi.cache.lease import MATCH_RULES
from marconi.cache.presets import PRESETS
from marconi.cache.tuning import TUNERS
from marconi.sim.latency import PROFILES
from marconi.sim.simulate import SimSpec, parse_bytes, simulate
from marconi.sim.trace_variants import load_variant, parse_variant
from marconi.units import AUTO, parse_alpha

_DEFAULT = SimSpec()


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        action="append",
        required=True,
        help="mooncake, sharegpt, swe, or a path to a .jsonl[.xz] trace, optionally with a variant"
        " (sharegpt+reasoning:share=0.5, swe+retokenized; marconi.sim.trace_variants); repeatable"
        " for sweep",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--num-sessions", type=int, default=100, help="sharegpt/swe sessions to load")
    p.add_argument(
        "--model",
        default="paper-7b",
        help=f"a preset ({', '.join(list_presets())}) or a config.json / HF folder",
    )
    p.add_argument("--mode", choices=("sequential", "concurrent"), default=_DEFAULT.mode)
    p.add_argument("--profile", choices=sorted(PROFILES), default=_DEFAULT.profile)
    p.add_argument("--workers", type=int, default=0, help="alpha-tuning processes (0 = cores)")
    p.add_argument(
        "--match-rule",
        choices=MATCH_RULES.supported_names(),
        default=_DEFAULT.match_rule,
        help="what a request may resume from: last-token (engine, SGLang) or full (paper)",
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="marconi-sim", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="one policy, one capacity, one trace")
    _trace_args(run)
    run.add_argument("--capacity", default="40GB", help="cache budget, e.g. 40GB, 512MiB")
    run.add_argument("--policy", choices=list(PRESETS), default=_DEFAULT.policy)
    run.add_argument("--alpha", default="auto", help="auto (tuned online) or a number")
    run.add_argument("--tuner", choices=TUNERS.supported_names(), default=_DEFAULT.tuner)
    run.add_argument("--json", action="store_true", help="print one JSON object")
    sweep = sub.add_parser("sweep", help="policies x capacities x traces -> CSV + PNG plots")
    _trace_args(sweep)
    sweep.add_argument("--capacity", action="append", help="repeatable; default 10/40/160GB")
    sweep.add_argument("--policy", action="append", choices=list(PRESETS), help="repeatable")
    sweep.add_argument("--out", type=Path, default=Path("results/sweep"))
    return ap


def _load(spec: str, args: argparse.Namespace):
    kw: dict[str, object] = {}
    base = parse_variant(spec)[0]
    if base == "mooncake":
        kw["limit"] = args.limit
    elif base in ("sharegpt", "swe"):
        kw["num_sessions"] = args.num_sessions
    trace = load_variant(spec, **kw)
    return trace[: args.limit] if args.limit else trace


def _alpha(text: str) -> str | float:
    try:
        alpha = parse_alpha(text)
    except ValueError as e:
        raise SystemExit(f"marconi-sim: --{e}") from None
    return AUTO if alpha is None else alpha


def cmd_run(args: argparse.Namespace) -> int:
    if len(args.trace) != 1:
        raise SystemExit("marconi-sim run: give exactly one --trace (use sweep for several)")
    alpha = _alpha(args.alpha)  # bad arguments fail before the trace is read
    cost = load_cost_model(args.model)
    trace = _load(args.trace[0], args)
    spec = SimSpec(
        policy=args.policy,
        capacity_bytes=parse_bytes(args.capacity),
        mode=args.mode,
        alpha=alpha,
        tuner=args.tuner,
        profile=args.profile,
        trace_name=Path(args.trace[0]).name,
        workers=args.workers,
        match_rule=args.match_rule,
    )
    result = simulate(trace, cost, spec, progress=not args.json and sys.stderr.isatty())
    print(json.dumps(result.to_dict()) if args.json else result.summary())
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from marconi.sim.plots import plot_hit_by_length, plot_hit_vs_capacity
    from marconi.sim.sweep import DEFAULT_VARIANTS, run_sweep, write_csv

    cost = load_cost_model(args.model)
    caps = [parse_bytes(c) for c in (args.capacity or ["10GB", "40GB", "160GB"])]
    variants = [v for v in DEFAULT_VARIANTS if not args.policy or v.policy in args.policy]
    traces = {Path(t).name: _load(t, args) for t in args.trace}
    base = SimSpec(
        mode=args.mode, profile=args.profile, workers=args.workers, match_rule=args.match_rule
    )
    rows = run_sweep(traces, cost, caps, variants, base)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "sweep.csv")
    pngs = plot_hit_vs_capacity(rows, args.out) + plot_hit_by_length(rows, args.out)
    for r in rows:
        res = r.result
        print(
            f"{res.trace:10s} {res.capacity_bytes / 1e9:7.1f}GB {r.label:24s}"
            f" hit {100 * res.token_hit_rate:6.2f}%  flops saved {100 * res.flops_saved:6.2f}%"
        )
    print(f"wrote {args.out / 'sweep.csv'} and {len(pngs)} plots")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return cmd_run(args) if args.cmd == "run" else cmd_sweep(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"marconi-sim: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

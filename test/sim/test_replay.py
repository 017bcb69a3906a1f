"""Replay invariants, alpha tuning on traces whose best alpha is known, and the CLI."""

from __future__ import annotations

import json

import pytest
from marconi.cache.cost import load_cost_model
from marconi.cache.prefix_cache import clone_cache
from marconi.cache.presets import PRESETS
from marconi.cache.tuning import ShadowTuner, replay_fed
from marconi.sim.cli import main
from marconi.sim.simulate import SimSpec, infinite_bound, parse_bytes, simulate
from marconi.sim.traces import default_trace_dir, load_trace
from marconi.units import parse_alpha
from synthetic import chat_sessions, one_off_docs_and_chats, recurring_docs, small_cache

COST = load_cost_model("paper-7b")
HAVE_TRACES = (default_trace_dir() / "sharegpt_multiturn.jsonl.xz").exists()
needs_traces = pytest.mark.skipif(not HAVE_TRACES, reason="../shared/traces is missing")


@pytest.fixture(scope="module")
def sharegpt():
    return load_trace("sharegpt", num_sessions=30)


@needs_traces
@pytest.mark.parametrize("mode", ["sequential", "concurrent"])
@pytest.mark.parametrize("policy", list(PRESETS))
def test_peak_bytes_never_exceed_the_budget(sharegpt, policy: str, mode: str) -> None:
    cap = parse_bytes("2GB")
    res = simulate(sharegpt, COST, SimSpec(policy=policy, capacity_bytes=cap, mode=mode, workers=1))
    assert 0 < res.peak_bytes <= cap
    assert res.requests == len(sharegpt)
    assert 0 <= res.hit_tokens <= res.input_tokens


@needs_traces
def test_hit_rates_stay_under_the_infinite_cache_bound(sharegpt) -> None:
    bound = infinite_bound(sharegpt, COST)
    for policy in PRESETS:
        res = simulate(sharegpt, COST, SimSpec(policy=policy, capacity_bytes=10**12, alpha=0.0))
        assert res.token_hit_rate <= bound + 1e-12
    res = simulate(sharegpt, COST, SimSpec(policy="marconi", capacity_bytes=10**12, alpha=0.0))
    assert res.token_hit_rate > 0.5  # multi-turn chat reuses most of its prompt


@needs_traces
def test_marconi_admits_far_fewer_states_than_vllm_plus(sharegpt) -> None:
    spec = SimSpec(capacity_bytes=parse_bytes("20GB"), alpha=0.0)
    marconi = simulate(sharegpt, COST, spec)
    vllm = simulate(sharegpt, COST, SimSpec(policy="vllm+", capacity_bytes=spec.capacity_bytes))
    assert marconi.states_admitted <= 2 * marconi.requests
    assert vllm.states_admitted > 5 * marconi.states_admitted
    assert marconi.state_reuse > vllm.state_reuse


def _hit(trace, alpha, tuner="shadow", policy="marconi-paper") -> tuple[float, list]:
    spec = SimSpec(policy=policy, capacity_bytes=10**9, alpha=alpha, tuner=tuner, workers=1)
    res = simulate(trace, COST, spec)
    return res.token_hit_rate, res.alpha_history


def test_tuner_moves_to_a_large_alpha_when_long_prefixes_recur() -> None:
    trace = recurring_docs(1200)
    lru, _ = _hit(trace, 0.0, policy="sglang+")
    zero, _ = _hit(trace, 0.0)
    best = max(_hit(trace, a)[0] for a in (2.0, 8.0))
    tuned, history = _hit(trace, "auto")
    assert best > zero + 0.2  # by construction: keeping the long documents wins
    assert history[-1][1] >= 2.0
    assert tuned > lru + 0.3


def test_tuner_stays_at_lru_like_alpha_when_recency_wins() -> None:
    trace = one_off_docs_and_chats(600)
    zero, _ = _hit(trace, 0.0)
    assert zero > _hit(trace, 2.0)[0] + 0.1  # by construction: recency wins
    tuned, history = _hit(trace, "auto")
    assert history == [(0, 0.0)]
    assert tuned == pytest.approx(zero)


def test_shadow_tuner_adapts_to_a_workload_shift_where_paper_tuning_does_not() -> None:
    trace = one_off_docs_and_chats(600) + recurring_docs(900, t0=1000, base=10**7)
    ours, history = _hit(trace, "auto", tuner="shadow")
    paper, paper_history = _hit(trace, "auto", tuner="paper")
    assert paper_history[-1][1] == 0.0  # tuned once, during the first workload
    assert any(i >= 600 and a >= 2.0 for i, a in history)  # re-tuned after the shift
    assert ours > paper + 0.1


def test_shadow_tuner_replays_one_request_per_observe_and_scores_whole_windows() -> None:
    """A server calls ``observe`` on its engine thread: each call replays only the request it
    is given (it used to replay a whole window at once, a ~100 ms stall every 64 requests on the
    tiny model), and a window's scores are still those of replaying the window from the
    shadows as they were when it began."""
    calls: list[int] = []

    def replay(cache, items):
        calls.append(len(items))
        return replay_fed(cache, items)

    cache = small_cache(6_000, 6, "learned", "hit-density")
    tuner = ShadowTuner(cache, replay=replay, workers=1, window=8, decay=1.0)
    reqs = [(r.input_ids, r.fed_ids) for r in chat_sessions(sessions=6, turns=5)]
    start = [clone_cache(s) for s in tuner.shadows]
    for i, req in enumerate(reqs[:16]):
        tuner.observe(req)
        if i == 7:  # the first window ended: its scores, then the second's from here
            first = [replay_fed(s, reqs[:8]) for s in start]
            assert tuner.totals == first
            start = [clone_cache(s) for s in tuner.shadows]
    second = [replay_fed(s, reqs[8:16]) for s in start]
    assert tuner.totals == [a + b for a, b in zip(first, second, strict=True)]
    assert calls == [1] * 16 * len(tuner.grid)
    assert sum(first) > 0  # the windows hit something: the comparison has teeth


@pytest.mark.parametrize(("lead", "switched_after"), [(1.015, 8), (1.03, 4)])
def test_a_decisive_lead_switches_after_one_window(lead: float, switched_after: int) -> None:
    """Hit density's tuner switches once a shadow has led by its margin (1%) for two windows in
    a row, or after one window when the lead is decisive (2.5% or more)."""
    cache = small_cache(6_000, 6, "learned", "hit-density")

    def replay(shadow, items):  # alpha 1's shadow scores ``lead`` times the others'
        return 100.0 * len(items) * (lead if shadow.alpha == 1.0 else 1.0)

    tuner = ShadowTuner(cache, replay=replay, workers=1, window=4)
    assert (tuner.patience, tuner.margin, tuner.decisive) == (2, 0.01, 0.025)
    alphas = []
    for _ in range(8):
        tuner.observe(None)
        alphas.append(cache.alpha)
    assert alphas == [0.0] * (switched_after - 1) + [1.0] * (9 - switched_after)


def test_parse_bytes_accepts_units_and_rejects_garbage() -> None:
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_parse_alpha_accepts_auto_and_non_negative_floats_only() -> None:
    assert (
        parse_alpha("auto") is None and parse_alpha(" AUTO ") is None and parse_alpha(None) is None
    )
    assert parse_alpha("0") == 0.0 and parse_alpha(2) == 2.0
    for bad in ("-1", "nan", "inf", "fast"):
        with pytest.raises(ValueError, match="alpha must be"):
            parse_alpha(bad)


def test_cli_rejects_a_negative_alpha(capsys) -> None:
    with pytest.raises(SystemExit, match="--alpha must be"):
        main(["run", "--trace", "sharegpt", "--capacity", "1GB", "--alpha", "-1"])


@needs_traces
def test_cli_run_json_has_the_documented_fields(capsys) -> None:
    argv = ["run", "--trace", "sharegpt", "--num-sessions", "5", "--capacity", "5GB", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "token_hit_rate",
        "request_hit_rate",
        "flops_saved",
        "peak_bytes",
        "capacity_bytes",
        "alpha",
        "requests",
        "wall_s",
    ):
        assert key in out
    assert out["capacity_bytes"] == 5 * 10**9 and out["peak_bytes"] <= out["capacity_bytes"]


def test_cli_reports_bad_arguments_clearly(capsys) -> None:
    assert main(["run", "--trace", "/nonexistent.jsonl", "--capacity", "1GB"]) == 2
    assert "error" in capsys.readouterr().err
    # a misspelt name is told apart from a missing file: the names are listed
    assert main(["run", "--trace", "sharegtp+reasoning", "--capacity", "1GB"]) == 2
    err = capsys.readouterr().err
    assert "sharegtp: no such trace file" in err and "mooncake, sharegpt, swe" in err
    assert main(["run", "--trace", "sharegpt", "--capacity", "huge"]) == 2


@needs_traces
def test_cli_sweep_writes_a_csv_and_the_plots(tmp_path, capsys) -> None:
    argv = ["sweep", "--trace", "sharegpt", "--num-sessions", "4", "--capacity", "1GB"]
    argv += ["--capacity", "4GB", "--policy", "sglang+", "--policy", "marconi-paper"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert rows[0].startswith("trace,model,policy,label")
    assert len(rows) == 1 + 2 * 3  # 2 capacities x (sglang+, marconi-paper x 2 tuners)
    for png in ("hit_vs_capacity_sharegpt.png", "hit_by_length_sharegpt.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"

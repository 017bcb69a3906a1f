"""The offline oracle: between the online policies and the infinite-cache bound, within budget,
and it admits only states that some later request wants."""

from __future__ import annotations

import numpy as np
import pytest
from marconi.cache.cost import load_cost_model
from marconi.cache.eviction import CandidateInfo
from marconi.sim.oracle import NEVER, BeladyFlops, future_uses, simulate_oracle
from marconi.sim.simulate import SimSpec, infinite_bound, simulate
from marconi.sim.traces import Request

COST = load_cost_model("paper-7b")


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 50_000, size=n)


def multi_turn(n_sessions: int = 12, turns: int = 6, seed: int = 0) -> list[Request]:
    """Interleaved chats: each turn's input is the previous turn's sequence plus a new message."""
    rng = np.random.default_rng(seed)
    history = {s: _ids(rng, int(rng.integers(50, 400))) for s in range(n_sessions)}
    reqs = []
    for t in range(n_sessions * turns):
        s = int(rng.integers(0, n_sessions))
        inp = history[s]
        out = _ids(rng, int(rng.integers(5, 120)))
        reqs.append(Request(f"chat{s}", t, float(t), inp, out))
        history[s] = np.concatenate([inp, out[:-1], _ids(rng, int(rng.integers(10, 80)))])
    return reqs


def shared_prefix(n: int = 80, seed: int = 1) -> list[Request]:
    """A few system prompts / documents shared by many one-off questions, plus noise."""
    rng = np.random.default_rng(seed)
    prompts = [_ids(rng, int(rng.integers(300, 1500))) for _ in range(5)]
    reqs = []
    for i in range(n):
        if rng.random() < 0.75:
            k = int(rng.zipf(1.5)) % len(prompts)
            inp = np.concatenate([prompts[k], _ids(rng, int(rng.integers(5, 60)))])
        else:
            inp = _ids(rng, int(rng.integers(100, 800)))
        reqs.append(Request(f"q{i}", 0, float(i), inp, _ids(rng, 8)))
    return reqs


def mixed(seed: int = 2) -> list[Request]:
    """Chats that all start from one of two system prompts."""
    rng = np.random.default_rng(seed)
    systems = [_ids(rng, 600), _ids(rng, 250)]
    reqs = multi_turn(10, 5, seed)
    out = []
    for r in reqs:
        sys_prompt = systems[int(r.session_id.removeprefix("chat")) % 2]
        inp = np.concatenate([sys_prompt, r.input_ids])
        out.append(Request(r.session_id, r.turn, r.arrival, inp, r.output_ids))
    return out


TRACES = {"multi_turn": multi_turn, "shared_prefix": shared_prefix, "mixed": mixed}


def _capacity(trace: list[Request], fraction: float) -> int:
    """``fraction`` of the bytes the whole trace's KV (input + output) would take."""
    tokens = sum(r.num_input_tokens + r.num_output_tokens for r in trace)
    return int(fraction * tokens * COST.kv_bytes_per_token) + 4 * COST.state_bytes


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("fraction", [0.02, 0.05, 0.15])
def test_oracle_hit_rate_is_between_online_policies_and_infinite_bound(
    name: str, fraction: float
) -> None:
    trace = TRACES[name]()
    cap = _capacity(trace, fraction)
    oracle = simulate_oracle(trace, COST, cap)
    assert oracle.policy == "oracle"
    assert oracle.requests == len(trace)
    assert oracle.peak_bytes <= cap
    assert oracle.states_reused <= oracle.states_admitted
    bound = infinite_bound(trace, COST)
    online = simulate(trace, COST, SimSpec(policy="sglang+", capacity_bytes=cap, alpha=0.0))
    assert oracle.token_hit_rate >= online.token_hit_rate
    # the oracle knows the future (a state at each request's longest shared prefix, Belady-style
    # eviction) but is no optimum under a tight budget: the learned admission beats it on the
    # mixed trace at 2% and 5% of the KV
    ours = simulate(trace, COST, SimSpec(policy="marconi", capacity_bytes=cap, alpha=0.0))
    assert ours.token_hit_rate <= bound + 1e-12
    assert oracle.token_hit_rate <= bound + 1e-12


@pytest.mark.parametrize("name", sorted(TRACES))
def test_oracle_with_room_for_everything_hits_every_state_it_admits_and_reaches_the_bound(
    name: str,
) -> None:
    trace = TRACES[name]()
    oracle = simulate_oracle(trace, COST, 2**50)
    future = future_uses(trace, COST)
    assert oracle.states_admitted > 0
    assert oracle.states_reused == oracle.states_admitted
    assert oracle.states_admitted <= len(future.uses)  # one state per wanted prefix at most
    assert oracle.token_hit_rate == pytest.approx(infinite_bound(trace, COST))


def test_oracle_admits_nothing_when_no_request_is_ever_reused() -> None:
    rng = np.random.default_rng(3)
    trace = [
        Request(f"u{i}", 0, float(i), 1_000_000 * (i + 1) + _ids(rng, 200), _ids(rng, 10))
        for i in range(20)
    ]
    oracle = simulate_oracle(trace, COST, _capacity(trace, 0.3))
    assert oracle.states_admitted == 0
    assert oracle.hit_tokens == 0


def test_future_uses_finds_each_requests_longest_earlier_prefix() -> None:
    a = np.arange(100)
    trace = [
        Request("s", 0, 0.0, a[:50], np.array([50, 51, 52])),  # inserts a[:52]
        Request("s", 1, 1.0, a[:80], np.array([7])),  # shares a[:52] with request 0
        Request("t", 0, 2.0, a[:30], np.array([1, 2])),  # a[:29]: its last token is prefilled
        Request("u", 0, 3.0, 10_000 + a[:40], np.array([1])),  # nothing in common
    ]
    future = future_uses(trace, COST)
    assert future.wanted == [0, 52, 29, 0]
    assert sorted(len(v) for v in future.rep.values()) == [29, 52]
    assert sorted(future.uses.values()) == [[1], [2]]
    assert future_uses(trace, COST, match_rule="full").wanted == [0, 52, 30, 0]


def test_oracle_on_paged_cache_stays_aligned_and_bounded() -> None:
    trace = mixed()
    cap = _capacity(trace, 0.15)
    oracle = simulate_oracle(trace, COST, cap, page_size=32)
    assert oracle.peak_bytes <= cap
    assert 0 < oracle.token_hit_rate <= infinite_bound(trace, COST, page_size=32) + 1e-12
    assert future_uses(trace, COST, page_size=32).wanted == [
        h - h % 32 for h in future_uses(trace, COST).wanted
    ]


def test_belady_evicts_never_used_first_then_furthest_and_least_efficient() -> None:
    policy = BeladyFlops()
    policy.now = 10
    never = policy.priority(CandidateInfo(NEVER, 100, 1e9))
    soon = policy.priority(CandidateInfo(11, 100, 1e9))
    late = policy.priority(CandidateInfo(50, 100, 1e9))
    soon_cheap = policy.priority(CandidateInfo(11, 100, 1e6))
    assert never < late < soon
    assert soon_cheap < soon


def test_oracle_rejects_models_without_ssm_layers() -> None:
    with pytest.raises(ValueError, match="SSM"):
        simulate_oracle(multi_turn(2, 2), "llama-3.1-8b", 10**9)

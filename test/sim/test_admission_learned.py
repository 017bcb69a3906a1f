"""The learned admission policy: ghost entries, what it learns per workload, its bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from marconi.cache.admission import AdmissionContext
from marconi.cache.admission_learned import _BASE, GhostAdmission, GhostTable, Kind, fingerprints
from marconi.cache.lease import Leases
from marconi.sim.replay import Replayer
from marconi.sim.trace_variants import reasoning, retokenized
from synthetic import chat_sessions, small_cache


def _replay(trace, admission: str = "learned", tokens: int = 1_000_000, states: int = 400):
    cache = small_cache(tokens, states, admission, "lru")
    rp = Replayer(cache)
    for req in trace:
        rp.serve(req)
        cache.check_integrity(deep=True)
    return cache, rp.hit_tokens


def test_exact_continuation_keeps_the_papers_choice() -> None:
    cache, hits = _replay(chat_sessions())
    assert cache.admission.enabled == {Kind.DECODED}
    _, paper = _replay(chat_sessions(), admission="marconi")
    assert hits >= 0.95 * paper  # the same once learned (the prior serves the first turns less)


def test_dropped_reasoning_switches_to_the_prompt_end() -> None:
    trace = reasoning(chat_sessions(), share=0.5)
    cache, hits = _replay(trace)
    assert Kind.PROMPT_END in cache.admission.enabled
    assert Kind.DECODED not in cache.admission.enabled
    _, paper = _replay(trace, admission="marconi")
    # the paper's only hits: the branch state that turn k-1 left at turn k-2's prompt end; ours
    # resume from turn k-1's prompt end (one turn deeper) once the ghosts have shown it
    assert hits > 1.1 * paper


def test_retokenized_replies_hit_before_the_mismatch() -> None:
    trace = retokenized(chat_sessions(), seed=3)
    cache, hits = _replay(trace)
    _, paper = _replay(trace, admission="marconi")
    assert Kind.PROMPT_END in cache.admission.enabled
    assert hits > paper


def test_identical_resend_resumes_one_token_before_the_prompt_end() -> None:
    """Engine semantics: a request matches ``tokens[:-1]`` (it prefills at least one token)."""
    cache = small_cache(200_000, 200, "learned")
    rng = np.random.default_rng(0)
    resumed = []
    for _ in range(40):
        prompt = rng.integers(0, 10**6, size=100)
        for _send in range(2):  # sent twice: a regenerate
            key = prompt[:-1]
            m = cache.match(key)
            cache.lock(m.node)
            plan = cache.plan_prefill(prompt, m, key)
            positions = plan.positions
            seq = np.concatenate([prompt, rng.integers(0, 10**6, size=5)])
            kv = np.concatenate([m.kv, cache.alloc_kv(len(seq) - len(m.kv))])
            states = dict(zip(positions, cache.alloc_states(len(positions)), strict=True))
            cache.insert(seq, kv, states, input_len=len(prompt), memo=plan.memo)
            cache.unlock(m.node)
            resumed.append(m.usable_len)
        cache.check_integrity(deep=True)
    assert Kind.RESEND in cache.admission.enabled
    assert resumed[-1] == 99  # all but the last token


@pytest.mark.parametrize("seed", range(5))
def test_positions_obey_the_contract_and_the_bound(seed: int) -> None:
    rng = np.random.default_rng(seed)
    policy = GhostAdmission(block=16)
    policy.enabled = set(Kind)
    for _ in range(200):
        n = int(rng.integers(1, 100))
        usable = int(rng.integers(0, n))
        bp = int(rng.integers(1, n + 1)) if rng.random() < 0.5 else None
        pre = policy.prefill_positions(AdmissionContext(n, usable, bp))
        seq = n + int(rng.integers(0, 50))
        dec = policy.decode_positions(n, seq)
        assert list(pre) == sorted(set(pre)) and all(usable < p <= n for p in pre)
        assert list(dec) == sorted(set(dec)) and all(n < p <= seq for p in dec)
        assert len(pre) + len(dec) <= 1 + len(Kind)


def _fps(tokens: np.ndarray, positions: list[int]) -> dict[int, int]:
    return dict(zip(positions, fingerprints(tokens, positions).values, strict=True))


def test_ghost_table_is_bounded_and_finds_the_deepest_ghost() -> None:
    table = GhostTable(capacity=3)
    seq = np.arange(100, dtype=np.int64)
    fps = _fps(seq, list(range(1, 101)))
    for pos, kind in ((10, Kind.PROMPT_END), (20, Kind.DECODED), (30, Kind.RESEND)):
        table.add(fps[pos], pos, kind)
    assert table.tried(0, 25, tries=8) == [10, 20]
    assert table.deepest(table.tried(0, 25, tries=8), fps) == (20, 1 << Kind.DECODED)
    assert table.tried(0, 100, tries=2) == [20, 30]  # the deepest ``tries`` positions
    assert table.deepest(table.tried(21, 25, tries=8), fps) is None
    other = _fps(np.arange(1, 101, dtype=np.int64), list(range(1, 101)))
    assert table.deepest(table.tried(0, 100, tries=8), other) is None  # other tokens
    table.add(fps[40], 40, Kind.ALIGNED_INPUT)  # pushes out the oldest (10)
    assert len(table.entries) == 3 and sorted(table._positions) == [20, 30, 40]
    assert table.deepest(table.tried(0, 15, tries=8), fps) is None


@given(
    st.lists(st.integers(0, 2**40), min_size=1, max_size=300),
    st.lists(st.integers(0, 2**40), min_size=1, max_size=300),
)
def test_a_fingerprint_is_the_whole_prefix(a: list[int], b: list[int]) -> None:
    """Two prefixes share a fingerprint exactly when they are equal (up to 64-bit hash
    collisions), however far back they differ: a conversation behind another system prompt of
    the same length must not find its earlier copy's ghosts."""
    positions = list(range(1, min(len(a), len(b)) + 1))
    ha, hb = fingerprints(np.array(a), positions), fingerprints(np.array(b), positions)
    for pos, x, y in zip(positions, ha.values, hb.values, strict=True):
        assert (x == y) == (a[:pos] == b[:pos])


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=3000), st.data())
def test_a_fingerprint_is_the_polynomial_hash_of_its_prefix(tokens: list[int], data) -> None:
    """``h(pos) = h(pos - 1) * B + t + 1 mod 2**64``, whatever the tokens' container and
    dtype, at any set of positions (one or two take the scalar path, more the vectorised one;
    the tables grow on demand), and from a ``carry`` as from the start."""
    want, h = [], 0
    for t in tokens:
        h = (h * _BASE + t + 1) % 2**64
        want.append(h)
    n = len(tokens)
    positions = sorted(data.draw(st.sets(st.integers(1, n), min_size=1, max_size=40)))
    start = data.draw(st.integers(0, positions[0] - 1))
    for given_tokens in (tokens, np.array(tokens, dtype=np.int64), np.array(tokens, np.int32)):
        got = fingerprints(given_tokens, positions)
        assert got.values == [want[p - 1] for p in positions]
        head = fingerprints(given_tokens, [start]) if start else fingerprints(given_tokens, [])
        tail = fingerprints(given_tokens, positions, start, head.carry)
        assert tail.values == got.values and tail.carry == got.carry


def test_a_fingerprint_sees_a_difference_far_back() -> None:
    long = np.arange(5000)
    other = long.copy()
    other[0] += 1  # differs at the first token only
    assert fingerprints(long, [5000]).values != fingerprints(other, [5000]).values


def test_the_prefill_memo_changes_nothing_but_the_work() -> None:
    """``observe_insert`` from ``observe_prefill``'s memo (fingerprinting the decoded tokens
    only) leaves the same ghosts and statistics as fingerprinting the whole sequence; a memo
    of another input length is ignored."""
    rng = np.random.default_rng(1)
    with_memo, without = GhostAdmission(block=16), GhostAdmission(block=16)
    prompt = rng.integers(0, 1000, size=40)
    for _ in range(60):
        fed = np.concatenate([prompt, rng.integers(0, 1000, size=int(rng.integers(0, 40)))])
        usable = int(rng.integers(0, len(prompt)))
        memo = with_memo.observe_prefill(prompt, len(prompt) - 1, usable)
        without.observe_prefill(prompt, len(prompt) - 1, usable)
        with_memo.observe_insert(fed, len(prompt), memo)
        without.observe_insert(fed, len(prompt))
        if rng.random() < 0.2:
            with_memo.observe_insert(fed, len(prompt) - 1, memo)  # not this input's memo
            without.observe_insert(fed, len(prompt) - 1)
        prompt = fed if rng.random() < 0.7 else rng.integers(0, 1000, size=30)
    assert with_memo.ghosts.entries == without.ghosts.entries
    assert with_memo.yields() == without.yields()


@pytest.mark.parametrize("n", [0, 1, 2])
def test_tiny_inputs_propose_only_real_positions(n: int) -> None:
    policy = GhostAdmission(block=1)
    prompt = np.arange(n, dtype=np.int64)
    memo = policy.observe_prefill(prompt, max(n - 1, 0), 0)
    policy.observe_insert(np.arange(n + 3, dtype=np.int64), n, memo)
    assert all(1 <= pos <= n + 3 for pos, _ in policy.ghosts.entries.values())
    assert policy.proposals[Kind.RESEND] == (n > 1)


def test_a_lease_carries_the_prefill_memo_to_its_insert() -> None:
    cache = small_cache(200_000, 200, "learned")
    leases = Leases(cache)
    prompt = np.arange(50, dtype=np.int64)
    lease = leases.begin(prompt, 60)
    assert lease is not None
    assert lease.memo is not None
    assert lease.memo == GhostAdmission().observe_prefill(prompt, 49, 0)  # the whole input's
    leases.decode(lease, 55)
    leases.finish(lease, np.concatenate([prompt, np.arange(5)]))
    cache.check_integrity(deep=True)


def test_a_clone_learns_apart_from_the_cache_it_was_cloned_from() -> None:
    """The alpha tuners replay what-ifs on clones (``clone_cache``): the learned admission's
    ghosts and yields must be the clone's own, or every shadow replay would teach the real
    cache's admission the same requests again."""
    from marconi.cache.prefix_cache import clone_cache

    trace = chat_sessions()
    cache, _ = _replay(trace[:20])
    before = (cache.admission.proposals.copy(), cache.admission.credit.copy())
    shadow = clone_cache(cache)
    assert shadow.admission is not cache.admission
    rp = Replayer(shadow)
    for req in trace[20:]:
        rp.serve(req)
    assert (cache.admission.proposals == before[0]).all()
    assert (cache.admission.credit == before[1]).all()
    assert shadow.admission.proposals.sum() > before[0].sum()

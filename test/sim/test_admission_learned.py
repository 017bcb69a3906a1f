"""The learned admission policy: ghost entries, what it learns per workload, its bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from marconi.cache.admission import AdmissionContext
from marconi.cache.admission_learned import _BASE, GhostAdmission, GhostTable, Kind, PrefixHashes
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
            positions = cache.plan_prefill(prompt, m, key)
            seq = np.concatenate([prompt, rng.integers(0, 10**6, size=5)])
            kv = np.concatenate([m.kv, cache.alloc_kv(len(seq) - len(m.kv))])
            states = dict(zip(positions, cache.alloc_states(len(positions)), strict=True))
            cache.insert(seq, kv, states, input_len=len(prompt))
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


def test_ghost_table_is_bounded_and_finds_the_deepest_ghost() -> None:
    table = GhostTable(capacity=3)
    seq = PrefixHashes(np.arange(100, dtype=np.int64))
    for pos, kind in ((10, Kind.PROMPT_END), (20, Kind.DECODED), (30, Kind.RESEND)):
        table.add(seq(pos), pos, kind)
    assert table.deepest(seq, 0, 25, tries=8) == (20, 1 << Kind.DECODED)
    assert table.deepest(seq, 21, 25, tries=8) is None
    other = PrefixHashes(np.arange(1, 101, dtype=np.int64))
    assert table.deepest(other, 0, 100, tries=8) is None  # same positions, other tokens
    table.add(seq(40), 40, Kind.ALIGNED_INPUT)  # pushes out the oldest (10)
    assert len(table.entries) == 3 and sorted(table._positions) == [20, 30, 40]
    assert table.deepest(seq, 0, 15, tries=8) is None


@given(
    st.lists(st.integers(0, 2**40), min_size=1, max_size=300),
    st.lists(st.integers(0, 2**40), min_size=1, max_size=300),
)
def test_a_fingerprint_is_the_whole_prefix(a: list[int], b: list[int]) -> None:
    """Two prefixes share a fingerprint exactly when they are equal (up to 64-bit hash
    collisions), however far back they differ: a conversation behind another system prompt of
    the same length must not find its earlier copy's ghosts."""
    ha, hb = PrefixHashes(np.array(a)), PrefixHashes(np.array(b))
    for pos in range(1, min(len(a), len(b)) + 1):
        assert (ha(pos) == hb(pos)) == (a[:pos] == b[:pos])


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=3000))
def test_a_fingerprint_is_the_polynomial_hash_of_its_prefix(tokens: list[int]) -> None:
    """``h(pos) = h(pos - 1) * B + t + 1 mod 2**64``, whatever the tokens' container and
    dtype, one position at a time or many at once (the tables grow on demand)."""
    want, h = [], 0
    for t in tokens:
        h = (h * _BASE + t + 1) % 2**64
        want.append(h)
    positions = list(range(1, len(tokens) + 1))
    for given_tokens in (tokens, np.array(tokens, dtype=np.int64), np.array(tokens, np.int32)):
        fp = PrefixHashes(given_tokens)
        assert [fp(p) for p in positions] == want
        assert fp.many(positions) == want


def test_a_fingerprint_sees_a_difference_far_back() -> None:
    long = np.arange(5000)
    other = long.copy()
    other[0] += 1  # differs at the first token only
    assert PrefixHashes(long)(5000) != PrefixHashes(other)(5000)


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

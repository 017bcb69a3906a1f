"""Hit-density eviction: the density estimate, what it learns on chat traffic, accounting."""

from __future__ import annotations

import numpy as np
import pytest
from marconi.cache import eviction_learned as el
from marconi.cache.admission import length_bin
from marconi.cache.eviction import CandidateInfo
from marconi.cache.integrity import IntegrityError
from marconi.cache.prefix_cache import PrefixCache, clone_cache
from marconi.cache.tuning import ShadowTuner
from marconi.sim.replay import Replayer
from synthetic import block_chains, chat_sessions, ending_chats, small_cache


def test_hit_density_is_hits_over_remaining_lifetime() -> None:
    hits = np.zeros(el._BINS)
    ends = np.zeros(el._BINS)
    b = int(el._age_bin(100))
    hits[b] = ends[b] = 4  # four lifetimes, each ending in a hit at age ~100
    ends[0] = 4  # four evicted at age 0
    d = el.hit_density(hits, ends)
    age = el._BIN_AGE[b]
    assert d[b] == pytest.approx(4 / 4)  # at the hit's age: one hit per tick left
    assert d[0] == pytest.approx(4 / (4 * (age + 1) + 4 * 1))
    assert d[b + 1] == 0.0  # nothing ever hits later


def test_bins_are_monotone_and_scalar_matches_vector() -> None:
    ages = np.array([0, 1, 2, 3, 7, 100, 10**6])
    bins = el._age_bin(ages)
    assert list(bins) == sorted(bins)
    assert [el._bin_of(int(a)) for a in ages] == list(bins)


def _chat_cache(eviction: str = "hit-density"):
    # room for about half of the sessions: evictions every turn
    cache = small_cache(6000, 10, "marconi", eviction)
    rp = Replayer(cache)
    for req in chat_sessions(sessions=10, turns=12):
        rp.serve(req)
        cache.check_integrity(deep=True)
    return cache, rp.hit_tokens


def test_chat_learns_that_a_continued_state_is_dead() -> None:
    cache, _ = _chat_cache()
    policy = cache.eviction
    inner_hit_once = el._HIT_BUCKETS * 0 + 1  # inner node, hit once
    tip = el._HIT_BUCKETS  # leaf, never hit
    assert policy.ends[inner_hit_once].sum() > 0
    for age in (1, 8, 24):
        assert policy.density(inner_hit_once, age) < policy.density(tip, age)


def test_the_eviction_memo_is_each_candidates_current_info() -> None:
    """The index keeps a candidate's info from its last change and a rebuild reads it back
    (``EvictionIndex.info_of``); ``check_integrity`` compares every live memo with a fresh
    info, so a change the tree did not report (``on_change``) is caught."""
    cache, _ = _chat_cache()  # checked after every request
    live = [n for n in cache.tree.iter_nodes() if cache.index.memo(n) is not None]
    assert live
    live[0].last_access -= 1  # a change nobody reported
    with pytest.raises(IntegrityError, match="stale eviction info"):
        cache.check_integrity()


def test_hit_density_of_many_classes_at_once_is_each_ones() -> None:
    rng = np.random.default_rng(0)
    hits = rng.random((el.KINDS, el._BINS)) * (rng.random((el.KINDS, el._BINS)) < 0.3)
    ends = hits + rng.random((el.KINDS, el._BINS)) * (rng.random((el.KINDS, el._BINS)) < 0.5)
    rows = el.hit_density(hits, ends)
    for k in range(el.KINDS):
        assert rows[k].tolist() == el.hit_density(hits[k], ends[k]).tolist()  # to the bit


def test_beats_lru_on_chat_under_contention() -> None:
    _, learned = _chat_cache()
    _, lru = _chat_cache("lru")
    assert learned > lru


def test_clone_keeps_its_own_learning() -> None:
    cache, _ = _chat_cache()
    copy = clone_cache(cache)
    copy.check_integrity(deep=True)
    before = cache.eviction.ends.sum()
    leaf = next(n for n in copy.tree.iter_nodes() if n.state is not None)
    copy.tree.on_hit(leaf)
    assert copy.eviction.ends.sum() == before + 1
    assert cache.eviction.ends.sum() == before


def _block_cache() -> PrefixCache:
    """``block_chains`` through ``marconi``'s policies, its alpha tuned from 1 (the worst start
    for a workload whose best alpha is 0)."""
    cache = small_cache(20_000, 12, "learned", "hit-density")
    cache.set_alpha(1.0)
    tuner = ShadowTuner(cache, workers=1, window=6)
    rp = Replayer(cache)
    for req in block_chains():
        tuner.observe((req.input_ids, req.fed_ids))
        rp.serve(req)
        cache.check_integrity(deep=True)
    return cache


def test_block_granular_reuse_holds_alpha_at_zero() -> None:
    cache = _block_cache()
    assert cache.admission.block_granular  # it learned the aligned input kind
    assert cache.eviction.block_granular and cache.eviction.alpha_hold == 0.0
    assert cache.alpha == 0.0  # the tuner keeps the hold, whatever its shadows say


def test_chat_reuse_is_not_block_granular() -> None:
    cache, _ = _chat_cache()
    assert not cache.admission.block_granular and not cache.eviction.block_granular
    assert cache.eviction.alpha_hold is None


def test_block_granular_density_is_per_byte() -> None:
    policy = el.HitDensity()
    small, big = (CandidateInfo(0, n, 0.0, el.class_of(True, 0), 512) for n in (10**6, 10**8))
    assert policy.priority(small) == policy.priority(big)  # chat: bytes play no part
    policy.observe_admission(_block_cache().admission)
    assert policy.priority(big) < policy.priority(small)  # the bigger goes first


def test_a_long_prefix_is_worth_what_its_hit_saves() -> None:
    policy = el.HitDensity()
    cut = policy.long_prefix
    leaf = el.class_of(True, 0)
    short, at_cut, twice = (CandidateInfo(0, 512, 0.0, leaf, n) for n in (100, cut, 2 * cut))
    assert policy.priority(short) == policy.priority(at_cut)  # up to the cut: density only
    assert policy.priority(twice) == pytest.approx(2 * policy.priority(at_cut))
    policy.observe_admission(_block_cache().admission)
    assert policy.priority(twice) == policy.priority(at_cut)  # block-granular reuse: no term


def _ending_replay(by_length: bool) -> tuple[PrefixCache, int]:
    cache = small_cache(4000, 10, "learned", "hit-density", by_length=by_length)
    rp = Replayer(cache)
    for req in ending_chats():
        rp.serve(req)
        cache.check_integrity(deep=True)
    return cache, rp.hit_tokens


def test_conversations_that_end_long_are_evicted_first() -> None:
    """The ghosts show which lengths are resumed (conversations end past 700 tokens here):
    short tips are kept over ended ones, uncensored by what the eviction kept."""
    cache, hits = _ending_replay(True)
    weight = cache.admission.reuse_by_length()
    assert weight is not None
    resumed, ended = length_bin(409), length_bin(689)  # turn 2's tip; the last turn's
    assert weight[ended] < 1.0 < weight[resumed]
    policy, leaf = cache.eviction, el.class_of(True, 0)
    short, long = (CandidateInfo(policy.now, 0, 0.0, leaf, n) for n in (409, 689))
    assert policy.priority(long) < policy.priority(short)
    inner = CandidateInfo(policy.now, 0, 0.0, el.class_of(False, 1), 689)  # not a tip: as before
    assert policy.priority(inner) == policy.density(inner.kind, 0)
    _, without = _ending_replay(False)
    assert hits > without

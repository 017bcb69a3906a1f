"""Unit tests of the hybrid radix tree and the prefix cache's accounting."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import abort, cost_for, finish, make_cache, serve, start, toks
from marconi.cache.node import MatchResult
from marconi.cache.pools import MemoryBudget
from marconi.cache.prefix_cache import CacheConfig, PrefixCache


def test_empty_cache_matches_nothing(hybrid_cache: PrefixCache) -> None:
    m = hybrid_cache.match(toks(range(10)))
    assert (m.kv_len, m.usable_len, m.state) == (0, 0, None)
    assert m.node is hybrid_cache.tree.root
    hybrid_cache.check_integrity(deep=True)


def _insert(cache: PrefixCache, tokens: np.ndarray, state_at: tuple[int, ...] = ()) -> None:
    """Insert ``tokens`` as a request would: fresh KV and one state per position."""
    kv = cache.alloc_kv(len(tokens))
    states = {pos: cache.alloc_state() for pos in state_at}
    cache.insert(tokens, kv, states)
    cache.check_integrity(deep=True)


def test_hybrid_hit_stops_at_deepest_state(hybrid_cache: PrefixCache) -> None:
    _insert(hybrid_cache, toks(range(100)), state_at=(40, 100))
    m = hybrid_cache.match(toks(range(70), 999))
    assert m.kv_len == 70  # KV is there for 70 tokens...
    assert m.usable_len == 40  # ...but the state exists only at 40
    assert m.node.state is not None and m.state == m.node.state
    assert len(m.kv) == 40


def test_hybrid_without_state_is_not_usable(hybrid_cache: PrefixCache) -> None:
    _insert(hybrid_cache, toks(range(50)))
    m = hybrid_cache.match(toks(range(50)))
    assert (m.kv_len, m.usable_len) == (50, 0)


def test_match_never_reports_a_false_prefix(hybrid_cache: PrefixCache) -> None:
    _insert(hybrid_cache, toks(1, 2, 3, 4), state_at=(4,))
    assert hybrid_cache.match(toks(1, 2, 3, 5)).kv_len == 3
    assert hybrid_cache.match(toks(1, 2, 3, 5)).usable_len == 0
    assert hybrid_cache.match(toks(2, 2, 3, 4)).kv_len == 0
    assert hybrid_cache.match(toks(1, 2)).usable_len == 0
    assert hybrid_cache.match(toks(1, 2, 3, 4, 5)).usable_len == 4


def test_attention_only_hit_can_end_inside_an_edge() -> None:
    cache = make_cache("attention")
    _insert(cache, toks(range(30)))
    m = cache.match(toks(range(12), 77))
    assert (m.kv_len, m.usable_len, m.state) == (12, 12, None)
    assert np.array_equal(m.kv, cache.match(toks(range(30))).kv[:12])


def test_pure_ssm_model_has_no_kv_and_hits_only_at_states() -> None:
    cache = make_cache("ssm")
    assert cache.pools.kv is None
    cache.insert(toks(range(20)), None, {10: cache.alloc_state()})
    cache.check_integrity(deep=True)
    m = cache.match(toks(range(20)))
    assert (m.kv_len, m.usable_len, m.kv) == (20, 10, None)


def test_paged_match_and_insert_stop_at_page_boundaries() -> None:
    cache = make_cache("hybrid", page_size=4)
    kv = cache.alloc_kv(3)  # 10 tokens = 2 full pages + a partial one
    cache.insert(toks(range(10)), kv, {8: cache.alloc_state(), 10: cache.alloc_state()})
    cache.check_integrity(deep=True)
    assert cache.tree.kv_slots == 2  # the partial page was freed
    assert cache.stats.states_declined == 1  # position 10 is not page aligned
    m = cache.match(toks(range(7), 99))
    assert (m.kv_len, m.usable_len) == (4, 0)
    assert cache.match(toks(range(10))).usable_len == 8


def test_two_requests_sharing_a_system_prompt_checkpoint_the_branch_point() -> None:
    cache = make_cache("hybrid", admission="marconi")
    system = list(range(1000, 1300))
    serve(cache, toks(system, range(10)), output_len=0)
    b = toks(system, range(50, 80))
    assert cache.branch_point(b) == 300
    run = start(cache, b)
    assert run is not None and list(run.captures) == [300]  # the purely-input prefix
    finish(cache, run, b)
    c = cache.match(toks(system, range(500, 520)))
    assert c.usable_len == 300  # a third request reuses the shared system prompt
    cache.check_integrity(deep=True)


def test_chat_continuation_hits_at_the_last_decoded_token() -> None:
    cache = make_cache("hybrid", admission="marconi")
    turn1 = toks(range(200))  # 150 input + 50 output tokens
    serve(cache, turn1, output_len=50)
    assert cache.tree.state_slots == 1  # only the state after the last decoded token
    turn2 = toks(range(200), range(5000, 5040))
    m = serve(cache, turn2, output_len=10)
    assert m.prefix_len == 200


def test_marconi_admits_at_most_two_states_per_request() -> None:
    cache = make_cache("hybrid", admission="marconi")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50, size=400)
    for i in range(20):
        cut = int(rng.integers(1, 400))
        before = cache.stats.states_admitted + cache.stats.states_declined
        serve(cache, np.concatenate([base[:cut], [10_000 + i] * 5]), output_len=2)
        assert cache.stats.states_admitted + cache.stats.states_declined - before <= 2


def test_every_n_admission_floods_states() -> None:
    cache = make_cache("hybrid", admission="every-n", n=32)
    serve(cache, toks(range(200)), output_len=40)
    assert cache.tree.state_slots == 200 // 32


def _fill_for_eviction(eviction: str, alpha: float) -> PrefixCache:
    """A long sequence used first, then short ones; the budget then forces one eviction."""
    cache = make_cache("hybrid", tokens=2300, states=5, eviction=eviction, alpha=alpha)
    serve(cache, toks(range(2000)), output_len=1)  # long: high FLOPs per byte
    for i in range(4):
        serve(cache, toks(range(10_000 * (i + 1), 10_000 * (i + 1) + 50)), output_len=1)
    serve(cache, toks(range(90_000, 90_200)), output_len=1)  # needs room
    return cache


def _has_state_at(cache: PrefixCache, tokens: np.ndarray) -> bool:
    return cache.match(tokens).usable_len == len(tokens)


def test_flop_aware_keeps_the_long_sequence_that_lru_evicts() -> None:
    lru = _fill_for_eviction("lru", 0.0)
    assert not _has_state_at(lru, toks(range(2000)))
    flop = _fill_for_eviction("flop-aware", 5.0)
    assert _has_state_at(flop, toks(range(2000)))
    assert not _has_state_at(flop, toks(range(10_000, 10_050)))


def test_single_child_node_gives_up_only_its_state_and_merges() -> None:
    cache = make_cache("hybrid", tokens=1000, states=2, eviction="flop-aware")
    _insert(cache, toks(range(100)), state_at=(50, 100))
    assert len(cache.tree.nodes) == 2
    upper = cache.match(toks(range(50))).node
    cache.tree.evict_node(upper)
    cache.check_integrity(deep=True)
    assert len(cache.tree.nodes) == 1  # merged into its child
    assert cache.tree.kv_slots == 100  # the KV stayed
    assert cache.match(toks(range(100))).usable_len == 100


def test_locked_entries_are_never_evicted() -> None:
    cache = make_cache("hybrid", tokens=300, states=3, shared=False)
    serve(cache, toks(range(200)), output_len=1)
    run = start(cache, toks(range(200), 7))  # resumes from the state at 200 and pins it
    assert run is not None and run.prefix_len == 200
    assert cache.alloc_kv(250) is None  # would need the pinned prefix
    assert cache.stats.alloc_failures == 1
    assert cache.match(toks(range(200))).usable_len == 200
    cache.check_integrity(deep=True)
    abort(cache, run)
    assert cache.alloc_kv(250) is not None  # unpinned: now it may go
    cache.check_integrity(deep=True)


def test_budget_is_never_exceeded_and_every_slot_comes_back() -> None:
    cache = make_cache("hybrid", tokens=500, states=4, admission="every-n", n=32)
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(10, 400))
        tokens = rng.integers(0, 3, size=n)
        run = start(cache, tokens)
        if run is not None:
            finish(cache, run, tokens)
        cache.check_integrity(deep=True)
        for meter in cache.pools.meters:
            assert meter.used <= meter.capacity and meter.peak <= meter.capacity
    info = cache.size_info()
    assert info.kv_in_flight == info.state_in_flight == 0
    assert info.kv_free + info.kv_cached + info.kv_locked == info.kv_total
    assert info.state_free + info.state_cached + info.state_locked == info.state_total


def test_request_longer_than_the_budget_is_declined_not_overcommitted() -> None:
    cache = make_cache("hybrid", tokens=100, states=2, shared=False)
    assert start(cache, toks(range(500))) is None
    cache.check_integrity(deep=True)
    assert cache.size_info().kv_in_flight == 0


def test_separate_pools_evict_only_what_is_short() -> None:
    cache = make_cache("hybrid", tokens=1000, states=1, shared=False)
    _insert(cache, toks(range(100)))  # older, holds KV only
    _insert(cache, toks(range(200, 210)), state_at=(10,))  # the state pool is now full
    slot = cache.alloc_state()  # LRU would pick the older leaf, but it frees no state
    assert slot is not None
    assert cache.tree.kv_slots == 100 and cache.tree.state_slots == 0
    cache.free_state(slot)
    cache.check_integrity(deep=True)


def test_duplicate_kv_of_a_concurrent_request_is_freed_on_insert() -> None:
    cache = make_cache("hybrid")
    prompt, fed = toks(range(99)), toks(range(100))
    a, b = start(cache, prompt, 100), start(cache, prompt, 100)
    assert a is not None and b is not None
    finish(cache, a, fed)
    finish(cache, b, fed)  # same tokens: its KV and state are duplicates
    cache.check_integrity(deep=True)
    assert cache.tree.kv_slots == 100 and cache.tree.state_slots == 1
    assert cache.size_info().kv_in_flight == 0


def test_evict_without_arguments_is_a_no_op(hybrid_cache: PrefixCache) -> None:
    _insert(hybrid_cache, toks(range(10)), state_at=(10,))
    result = hybrid_cache.evict()
    assert (result.kv_slots_freed, result.states_freed, result.fits) == (0, 0, True)


def test_unknown_policy_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        PrefixCache(cost_for("hybrid"), MemoryBudget.shared(10**9), CacheConfig(eviction="mru"))


def test_match_result_fields_are_exact(hybrid_cache: PrefixCache) -> None:
    _insert(hybrid_cache, toks(range(10)), state_at=(6,))
    m = hybrid_cache.match(toks(range(8), 99))
    assert isinstance(m, MatchResult)
    assert (m.kv_len, m.usable_len, m.state, m.node.end) == (8, 6, m.node.state, 6)
    assert m.kv is not None and len(m.kv) == 6  # the KV of the usable prefix only

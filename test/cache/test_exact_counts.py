"""Exact slot ids, free lists and counts after each step of ``CacheManager``, ``Scheduler`` and
``Replayer`` (as vLLM's prefix-caching tests assert block ids), on separate KV / state pools so
that the ids are predictable: fresh ids count up, freed ids are reused last-freed first."""

from __future__ import annotations

import numpy as np
from conftest import make_cache, toks
from marconi.cache.lease import Leases
from marconi.cache.node import SizeInfo
from marconi.cache.prefix_cache import PrefixCache
from marconi.engine.cache_manager import CacheManager
from marconi.engine.request import Detokenizer, Req, SamplingParams
from marconi.engine.scheduler import Scheduler
from marconi.sim.replay import Replayer
from marconi.sim.traces import Request
from test_lifecycle import FakeMemory, FakeTokenizer, snapshot


def _cache(**kw: object) -> PrefixCache:
    return make_cache("hybrid", tokens=100, states=10, shared=False, **kw)  # type: ignore[arg-type]


def _size(cache: PrefixCache, **fields: int) -> None:
    """``size_info()`` equals the idle empty cache's except for ``fields``."""
    empty = {"kv_total": 100, "kv_free": 100, "state_total": 10, "state_free": 10}
    zero = {f: 0 for f in SizeInfo._fields if f not in empty}
    got = cache.size_info()._asdict()
    want = {**zero, **empty, **fields}
    got.pop("used_bytes"), got.pop("capacity_bytes"), want.pop("used_bytes", None)
    want.pop("capacity_bytes", None)
    assert got == want


def test_cache_manager_slots_copies_and_counts_step_by_step() -> None:
    cache, memory = _cache(), FakeMemory()
    mgr = CacheManager(Leases(cache), memory)
    prompt = toks(range(10))
    a = mgr.admit(prompt, 12)
    assert a is not None
    assert (a.pages.tolist(), a.n_prefix, a.working, a.captures) == (list(range(12)), 0, 0, {})
    assert mgr.token_slots(a, 8, 12).tolist() == [8, 9, 10, 11]
    _size(cache, kv_free=88, kv_in_flight=12, state_free=9, state_in_flight=1)
    mgr.before_decode(a, 10)
    mgr.before_decode(a, 11)
    assert memory.copies == []  # marconi's decode state is the working slot itself
    fed = toks(range(10), 50, 51)
    mgr.finish(a, fed)
    _size(cache, kv_free=88, kv_cached=12, state_free=9, state_cached=1, nodes=1)
    (node,) = cache.tree.iter_nodes()
    assert (node.start, node.end, node.state, node.kv.tolist()) == (0, 12, 0, list(range(12)))

    b = mgr.admit(np.concatenate([fed, toks(52, 1, 2, 3)]), 18)  # continues the conversation
    assert b is not None and b.prefix_len == 12
    assert (b.pages.tolist(), b.n_prefix, b.working) == (list(range(18)), 12, 1)
    assert memory.copies == [(0, 1)]  # the working slot restored from the tree's state
    _size(cache, kv_free=82, kv_locked=12, kv_in_flight=6, state_free=8, state_locked=1,
          state_in_flight=1, nodes=1)  # fmt: skip
    mgr.abort(b)
    _size(cache, kv_free=88, kv_cached=12, state_free=9, state_cached=1, nodes=1)
    snap = snapshot(cache)
    assert snap.kv_free == ((12, 13, 14, 15, 16, 17), 18) and snap.state_free == ((1,), 2)

    again = mgr.admit(prompt, 12)  # the same prompt: the state sits after 12, not within 9
    assert again is not None and again.prefix_len == 0
    assert again.pages.tolist() == list(range(12, 24))  # the freed ids first, then fresh ones
    # speculative insertion on the match key (the prompt but its last token): 9 splits the edge
    assert (again.working, again.captures) == (1, {9: 2})


def test_scheduler_batches_slots_and_decode_captures_exactly() -> None:
    cache, memory, tok = _cache(admission="every-n", n=4), FakeMemory(), FakeTokenizer()
    sched = Scheduler(CacheManager(Leases(cache), memory), tok, 4, 512)
    req = Req("r", toks(range(6)), SamplingParams(max_tokens=4), max_new_tokens=4)
    req.detok = Detokenizer(tok, ())
    sched.add(req)
    seen = []
    for out in (40, 41, 42, 43):
        batch, failed = sched.schedule()
        assert batch is not None and not failed
        (inp,) = batch.inputs
        seen.append((list(inp.token_ids), inp.kv_slots.tolist(), inp.state_slot,
                     inp.capture_positions, inp.capture_slots, batch.fed_after))  # fmt: skip
        sched.postprocess(batch, [out])
    assert seen == [
        ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], 0, (4,), (1,), (6,)),  # prefill, capture at 4
        ([40], [0, 1, 2, 3, 4, 5, 6], 0, (), (), (7,)),
        ([41], [0, 1, 2, 3, 4, 5, 6, 7], 0, (), (), (8,)),
        ([42], [0, 1, 2, 3, 4, 5, 6, 7, 8], 0, (), (), (9,)),  # the state after 8 copied out
    ]
    assert memory.copies == [(0, 2)]
    assert (req.finish_reason, req.output_ids, req.cached_tokens) == ("length", [40, 41, 42, 43], 0)
    # finish: states at 4 and 8 go to the tree, the working slot (9 is not planned) is freed
    _size(cache, kv_free=91, kv_cached=9, state_free=8, state_cached=2, nodes=3)
    assert snapshot(cache).state_free == ((0,), 3)
    assert sorted((n.start, n.end, n.state) for n in cache.tree.iter_nodes()) == [
        (0, 4, 1), (4, 8, 2), (8, 9, None)
    ]  # fmt: skip
    assert not sched.has_work()


def test_replayer_records_exact_hits_states_and_uncached_requests() -> None:
    cache = _cache()
    rp = Replayer(cache)
    t1 = Request("s", 0, 0.0, toks(range(10)), toks(50, 51, 52))
    t2 = Request("s", 1, 1.0, np.concatenate([t1.fed_ids, toks(52, 1, 2, 3, 4, 5)]), toks(7, 8))
    t3 = Request("t", 0, 2.0, t2.input_ids, toks(9))  # same input as t2
    huge = Request("u", 0, 3.0, toks(range(1000, 1200)), toks(1))  # more KV than the budget
    hits = [rp.serve(r).hit_len for r in (t1, t2, t3, huge)]
    assert hits == [0, 12, 12, 0]
    assert (rp.hit_tokens, rp.uncached, len(rp.reused_states)) == (24, 1, 1)
    # t3's key (its input but the last token) ends inside t2's edge: its branch checkpoint
    # (slot 3) splits it at 17, where a resend of this input would resume; its
    # working slot 2 is freed (a 1-token output plans no decode state); huge evicted nothing
    # (its insert, which ends at 18, splits the edge there too)
    _size(cache, kv_free=81, kv_cached=19, state_free=7, state_cached=3, nodes=4)
    assert sorted((n.start, n.end, n.state) for n in cache.tree.iter_nodes()) == [
        (0, 12, 0), (12, 17, 3), (17, 18, None), (18, 19, 1)
    ]  # fmt: skip
    assert snapshot(cache).state_free == ((2,), 4)
    res = rp.result(trace="t", policy="p", mode="sequential", capacity_bytes=0, alpha=None,
                    states_admitted=cache.stats.states_admitted, wall_s=0.0)  # fmt: skip
    assert (res.requests, res.hit_tokens, res.input_tokens, res.uncached_requests) == (
        4, 24, 10 + 18 + 18 + 200, 1
    )  # fmt: skip

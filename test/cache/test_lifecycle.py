"""One lifecycle: the engine (real ``Scheduler`` + ``CacheManager``, a fake memory, no model)
and the simulator's ``Replayer`` driven through the same request sequences must see the same
hits and captures and leave the same free lists, tree and ``SizeInfo`` after every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pytest
from conftest import make_cache, toks
from marconi.cache.lease import Leases
from marconi.cache.node import SizeInfo
from marconi.cache.pools import SlotPool
from marconi.cache.prefix_cache import PrefixCache
from marconi.engine.cache_manager import CacheManager
from marconi.engine.request import Detokenizer, Req, SamplingParams, Status
from marconi.engine.scheduler import Scheduler
from marconi.sim.replay import Flight, Replayer
from marconi.sim.traces import Request


class FakeMemory:
    """Records the state copies a lease asks for (the only data the engine moves)."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, int]] = []

    def copy_state(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))


class FakeTokenizer:
    eos_token_id = None

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


class Snapshot(NamedTuple):
    size: SizeInfo
    kv_free: tuple[tuple[int, ...], int]
    state_free: tuple[tuple[int, ...], int]
    tree: tuple[tuple[int, int, int | None, tuple[int, ...]], ...]


def _free(pool: SlotPool | None) -> tuple[tuple[int, ...], int]:
    if pool is None:
        return (), 0
    return tuple(pool._recycled[: pool._num_recycled].tolist()), pool._next_fresh


def snapshot(cache: PrefixCache) -> Snapshot:
    cache.check_integrity(deep=True)
    nodes = sorted(
        (n.start, n.end, n.state, tuple(() if n.kv is None else n.kv.tolist()))
        for n in cache.tree.iter_nodes()
    )
    return Snapshot(
        cache.size_info(), _free(cache.pools.kv), _free(cache.pools.state), tuple(nodes)
    )


@dataclass(frozen=True)
class Step:
    """One engine step seen from the cache: the requests admitted (index, hit, planned
    captures), then aborted, at the schedule; the requests finished at the postprocess; and the
    cache after each half."""

    admitted: tuple[tuple[int, int, tuple[int, ...]], ...]
    after_admit: Snapshot
    finished: tuple[int, ...]
    after_finish: Snapshot


def _req(inp: np.ndarray, out: np.ndarray, i: int) -> Request:
    return Request("s", i, float(i), inp, out)


def run_engine(
    cache: PrefixCache, trace: list[Request], aborts: set[int], max_running: int = 1
) -> tuple[list[Step], FakeMemory]:
    """Serve ``trace`` through the real scheduler (all queued at once, FCFS); each request
    decodes its trace outputs; requests in ``aborts`` are aborted right after admission."""
    memory, tok = FakeMemory(), FakeTokenizer()
    sched = Scheduler(CacheManager(Leases(cache), memory), tok, max_running, 10**6)
    reqs = []
    for i, r in enumerate(trace):
        n = r.num_output_tokens
        req = Req(f"r{i}", r.input_ids, SamplingParams(max_tokens=n), max_new_tokens=n)
        req.detok = Detokenizer(tok, ())
        reqs.append(req)
        sched.add(req)
    steps: list[Step] = []
    started: set[int] = set()
    while sched.has_work():
        batch, failed = sched.schedule()
        assert not failed and batch is not None
        admitted = []
        for i, req in enumerate(reqs):
            if req.status is Status.RUNNING and i not in started:
                started.add(i)
                lease = req.lease
                assert lease is not None
                if lease.prefix_len:  # the working slot was restored from the matched state
                    assert memory.copies[-1] == (lease.match.state, lease.working)
                admitted.append((i, req.cached_tokens, tuple(sorted(lease.captures))))
        for i, _, _ in admitted:
            if i in aborts:
                sched.abort(reqs[i].rid)
        after_admit = snapshot(cache)
        running = [i for i, r in enumerate(reqs) if r.status is Status.RUNNING]
        tokens = []
        for req, sample in zip(batch.reqs, batch.samples, strict=True):
            i = reqs.index(req)
            tokens.append(int(trace[i].output_ids[len(req.output_ids)]) if sample else None)
        sched.postprocess(batch, tokens)
        done = tuple(i for i in running if reqs[i].status is Status.FINISHED)
        assert all(reqs[i].finish_reason == "length" for i in done)
        steps.append(Step(tuple(admitted), after_admit, done, snapshot(cache)))
    return steps, memory


def run_replayer(
    cache: PrefixCache, trace: list[Request], aborts: set[int], max_running: int = 1
) -> list[Step]:
    """The same requests through ``Replayer.begin`` / ``end`` / ``abort`` on the engine's
    clock: admitted FCFS while fewer than ``max_running`` run, a request with ``n`` outputs
    finishes ``n - 1`` steps after its admission (its prefill step samples the first)."""
    rp = Replayer(cache)
    queue = list(range(len(trace)))
    flights: dict[int, tuple[int, Flight]] = {}  # index -> (finish step, flight); FCFS order
    steps: list[Step] = []
    step = 0
    while queue or flights:
        for i, (end, flight) in flights.items():  # decodes run first, in admission order
            rp.advance(flight, len(trace[i].fed_ids) - (end - step))
        admitted = []
        while queue and len(flights) < max_running:
            i = queue.pop(0)
            flight = rp.begin(trace[i])
            assert flight.lease is not None
            flights[i] = (step + trace[i].num_output_tokens - 1, flight)
            admitted.append((i, flight.lease.prefix_len, tuple(sorted(flight.lease.captures))))
        for i, _, _ in admitted:
            if i in aborts:
                rp.abort(flights.pop(i)[1])
        after_admit = snapshot(cache)
        done = tuple(i for i, (end, _) in flights.items() if end == step)
        for i in done:
            rp.end(flights.pop(i)[1])
        steps.append(Step(tuple(admitted), after_admit, done, snapshot(cache)))
        step += 1
    return steps


def _scenarios() -> dict[str, tuple[list[Request], set[int], int]]:
    rng = np.random.default_rng(0)

    def ids(n: int) -> np.ndarray:
        return rng.integers(0, 50, size=n).astype(np.int64)

    p, o = ids(20), ids(6)
    first = _req(p, o, 0)
    cont = _req(np.concatenate([first.fed_ids, o[-1:], ids(7)]), ids(5), 1)
    system = ids(24)
    branch = [_req(np.concatenate([system, ids(9)]), ids(4), i) for i in range(3)]
    pressure = [_req(ids(int(rng.integers(8, 40))), ids(int(rng.integers(2, 9))), i)
                for i in range(12)]  # fmt: skip
    pressure += [_req(np.concatenate([pressure[3].fed_ids, ids(5)]), ids(3), 12)]
    return {
        "identical-prompt": ([first, _req(p, o, 1)], set(), 1),
        "prompt-equal-to-fed": ([first, _req(first.fed_ids, ids(3), 1)], set(), 1),
        "continuation": ([first, cont], set(), 1),
        "branch": (branch, set(), 1),
        "abort": ([first, _req(p, o, 1), cont], {1}, 1),
        "eviction-under-pressure": (pressure, {5}, 1),
        "two-in-flight": ([first, _req(p, ids(4), 1), cont, *branch], {3}, 2),
    }


POLICIES = {
    "marconi-lru": {"admission": "marconi", "eviction": "lru"},
    "marconi-flop": {"admission": "marconi", "eviction": "flop-aware", "alpha": 2.0},
    "every-4": {"admission": "every-n", "n": 4},
    "chunk-aligned-8": {"admission": "chunk-aligned", "interval": 8},
    "paged-every-4": {"admission": "every-n", "n": 4, "page_size": 4},
}


@pytest.mark.parametrize("scenario", list(_scenarios()))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_engine_and_replayer_count_the_same(policy: str, scenario: str) -> None:
    trace, aborts, max_running = _scenarios()[scenario]
    kw = dict(POLICIES[policy])
    budget = {"tokens": 120, "states": 6} if scenario == "eviction-under-pressure" else {}
    engine_cache = make_cache("hybrid", **budget, **kw)  # type: ignore[arg-type]
    sim_cache = make_cache("hybrid", **budget, **kw)  # type: ignore[arg-type]
    engine, memory = run_engine(engine_cache, trace, aborts, max_running)
    replay = run_replayer(sim_cache, trace, aborts, max_running)
    assert len(engine) == len(replay)
    for n, (e, r) in enumerate(zip(engine, replay, strict=True)):
        assert (e.admitted, e.finished) == (r.admitted, r.finished), n
        assert e.after_admit == r.after_admit, n
        assert e.after_finish == r.after_finish, n
    restores = sum(1 for e in engine for _, hit, _ in e.admitted if hit)
    assert len(memory.copies) >= restores  # + one copy per decode capture
    if scenario == "eviction-under-pressure":
        assert engine_cache.stats.evicted_nodes > 0
    assert engine_cache.size_info().kv_in_flight == engine_cache.size_info().state_in_flight == 0


def test_a_prompt_equal_to_the_fed_tokens_resumes_from_zero_in_engine_tuner_and_replay() -> None:
    """The issue's probe: the engine prefills at least the last token, so a prompt equal to the
    previous request's fed tokens cannot resume at the state after them; the tuner's replay
    (``replay_fed``) and the simulator now count the same 0, the paper's rule the full 26."""
    from marconi.cache.tuning import replay_fed

    first = _req(toks(range(20)), toks(range(100, 107)), 0)
    again = _req(first.fed_ids, toks(7, 8), 1)
    items = [(r.input_ids, r.fed_ids) for r in (first, again)]
    assert replay_fed(make_cache(), items) == 0
    steps, _ = run_engine(make_cache(), [first, again], set())
    assert [hit for s in steps for _, hit, _ in s.admitted] == [0, 0]
    assert replay_fed(make_cache(match_rule="full"), items) == 26


@pytest.mark.parametrize(
    "name, args",
    [("marconi", {}), ("every-n", {"n": 4}), ("chunk-aligned", {"interval": 8}),
     ("align-junctions", {"block": 8})],
)  # fmt: skip
def test_closed_form_capture_points_equal_the_definition(name: str, args: dict) -> None:
    """``capture_points`` overrides == the generic definition (``fed`` is a capture point iff
    ``fed in decode_positions(input_len, fed + 1)``)."""
    from marconi.cache.admission import ADMISSION_POLICIES, AdmissionPolicy

    policy = ADMISSION_POLICIES.create(name, **args)
    for input_len in (0, 3, 8, 13):
        for lo in range(input_len, input_len + 20):
            for hi in range(lo, input_len + 30, 3):
                want = AdmissionPolicy.capture_points(policy, input_len, lo, hi)
                assert policy.capture_points(input_len, lo, hi) == want, (input_len, lo, hi)

"""The offline oracle: an upper reference that knows every future request (not a real policy).

It replays a trace through the same ``PrefixCache`` as ``simulate`` (exact byte budget,
sequential paper mode, same metrics), with two changes that need the future:

* **Admission.** A pre-pass over the trace (an unbounded tree of all earlier sequences, as in
  ``infinite_bound``) finds for each request ``j`` its longest common prefix ``h_j`` with every
  earlier sequence (input + output[:-1]). Request ``i`` checkpoints the state at position ``p``
  of its sequence only if a later request ``j > i`` has ``h_j == p`` over the same tokens: every
  admitted state is one some later request wants (it may still be evicted before then).
* **Eviction.** Belady weighted by FLOPs per byte: a candidate's priority is
  ``flop_efficiency / (next_use - now + 1)``, lowest evicted first; a candidate nobody uses again
  (no state, or a state with no later request wanting it) goes first.

Belady is optimal only for equal sizes and costs, and a request that would fall back to a
shallower state when the exact one is gone is not counted as a use, so the oracle is a strong
reference for how much room online policies leave, not a proven optimum. Its hit rate is at most
``infinite_bound`` (each hit is at most ``h_j`` tokens).

Prefixes are identified by ``(length, 64-bit polynomial hash)`` and confirmed token by token.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from marconi.cache.admission import PrefillPlan
from marconi.cache.cost import CostModel, load_cost_model
from marconi.cache.eviction import CandidateInfo, EvictionIndex, EvictionPolicy
from marconi.cache.node import EvictResult, InsertResult, MatchResult, Node
from marconi.cache.pools import MemoryBudget
from marconi.cache.prefix_cache import CacheConfig, PrefixCache
from marconi.sim.latency import get_profile
from marconi.sim.metrics import SimResult
from marconi.sim.replay import Replayer
from marconi.sim.simulate import shared_prefixes
from marconi.sim.traces import Request

#: next-use index of a candidate no later request will use
NEVER = 2**62

_BASE = np.uint64(0x100000001B3)
_LEN_MIX = np.uint64(0x9E3779B97F4A7C15)


class _Hasher:
    """Prefix hashes ``H[p] = sum_{t<p} (tok[t] + 1) * B^(t+1)`` mod 2^64, mixed with ``p``."""

    def __init__(self) -> None:
        self._pw = np.empty(0, dtype=np.uint64)

    def prefixes(self, tokens: np.ndarray) -> np.ndarray:
        """Keys of every prefix ``tokens[:p]``, ``p = 0..len(tokens)`` (uint64 array)."""
        n = len(tokens)
        if len(self._pw) < n:
            self._pw = np.cumprod(np.full(max(n, 2 * len(self._pw)), _BASE, dtype=np.uint64))
        terms = (tokens.astype(np.uint64) + np.uint64(1)) * self._pw[:n]
        h = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(terms, dtype=np.uint64)])
        return h ^ (np.arange(n + 1, dtype=np.uint64) * _LEN_MIX)


@dataclass(frozen=True)
class Future:
    """What the oracle knows before the replay.

    ``wanted[j]``: request ``j``'s longest (page-aligned) common prefix with all earlier
    sequences. ``uses[key]``: the increasing request indices ``j`` whose ``wanted`` prefix has
    that key; ``rep[key]`` one such prefix's tokens (to confirm hash matches). ``keys``: all keys,
    sorted (for a vectorised membership test).
    """

    wanted: list[int]
    uses: dict[int, list[int]]
    rep: dict[int, np.ndarray]
    keys: np.ndarray


def future_uses(
    trace: Sequence[Request],
    cost: CostModel,
    page_size: int = 1,
    hasher: _Hasher | None = None,
    match_rule: str = "last-token",
) -> Future:
    """Pre-pass: each request's longest common prefix with all earlier sequences, keyed."""
    hasher = hasher or _Hasher()
    wanted, _ = shared_prefixes(trace, cost, page_size, match_rule)
    uses: dict[int, list[int]] = {}
    rep: dict[int, np.ndarray] = {}
    for j, (req, h) in enumerate(zip(trace, wanted, strict=True)):
        if h:
            key = int(hasher.prefixes(req.input_ids[:h])[h])
            uses.setdefault(key, []).append(j)
            rep.setdefault(key, req.input_ids[:h])
    keys = np.array(sorted(uses), dtype=np.uint64)
    return Future(wanted, uses, rep, keys)


class BeladyFlops(EvictionPolicy):
    """Evict the candidate whose next use is furthest away, weighted by FLOPs saved per byte:
    ``priority = flop_efficiency / (next_use - now + 1)``; never used again: -1.

    Only for ``OracleCache``, which fills ``CandidateInfo.last_access`` with the candidate's
    *next use* (a request index; ``NEVER`` if none) and sets ``now`` before each request.
    Deliberately not in ``EVICTION_POLICIES``: no preset can select it.
    """

    name = "oracle"
    single_child = True

    def __init__(self) -> None:
        self.now = 0

    def priority(self, info: CandidateInfo) -> float:
        if info.last_access >= NEVER:
            return -1.0
        return info.flop_efficiency / (info.last_access - self.now + 1)


class OracleCache(PrefixCache):
    """A ``PrefixCache`` whose admission and eviction read the ``Future``.

    Driving contract (sequential): ``prepare(i, req)`` before serving request ``i`` with the
    usual lifecycle (``Replayer.serve``); ``insert`` remembers which planned prefix each
    inserted state checkpoints.
    """

    def __init__(
        self,
        cost: CostModel,
        budget: MemoryBudget,
        future: Future,
        page_size: int = 1,
        match_rule: str = "last-token",
    ) -> None:
        config = CacheConfig("marconi", {}, "lru", page_size=page_size, match_rule=match_rule)
        super().__init__(cost, budget, config)
        self.future = future
        self.hasher = _Hasher()
        self.eviction: BeladyFlops = BeladyFlops()
        self.index = EvictionIndex(self.tree, self.eviction, self._candidate_info)
        self.tree.on_change = self.index.changed
        self.now = -1
        self._fitted_at = -1
        self._plan: dict[int, int] = {}  # position -> prefix key, for the current request
        self._slot_key: dict[int, int] = {}  # state slot -> key of the prefix it checkpoints
        self._seq = np.empty(0, dtype=np.int64)

    # -------------------------------------------------------------- admission
    def prepare(self, i: int, req: Request) -> None:
        """Start request ``i``: find the positions of its sequence that a later request wants."""
        self.now = self.eviction.now = i
        self._seq = seq = req.fed_ids
        self._plan = {}
        if not len(self.future.keys):
            return
        keys = self.hasher.prefixes(seq)
        pos = np.flatnonzero(np.isin(keys, self.future.keys))
        for p in pos.tolist():
            key = int(keys[p])
            uses = self.future.uses[key]
            if p and uses[-1] > i and np.array_equal(self.future.rep[key], seq[:p]):
                self._plan[p] = key

    def _wanted(self, lo: int, hi: int) -> tuple[int, ...]:
        """Planned positions in ``(lo, hi]`` where the tree holds no state yet."""
        return tuple(
            p for p in sorted(self._plan) if lo < p <= hi and not self._has_state(self._seq[:p])
        )

    def _has_state(self, prefix: np.ndarray) -> bool:
        path, partial, pos = self.tree._walk(prefix)  # read-only
        return partial is None and pos == len(prefix) and bool(path) and path[-1].state is not None

    def plan_prefill(
        self, tokens: np.ndarray, match: MatchResult, key: np.ndarray | None = None
    ) -> PrefillPlan:
        return PrefillPlan(self._wanted(match.usable_len, len(tokens)))

    def plan_decode(self, input_len: int, seq_len: int) -> tuple[int, ...]:
        return self._wanted(input_len, seq_len)

    def capture_points(self, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
        return self._wanted(max(lo - 1, input_len), hi - 1)  # p in [lo, hi) is captured at p

    def insert(
        self,
        tokens: np.ndarray,
        kv: np.ndarray | None,
        states: dict[int, int] | None = None,
        input_len: int | None = None,
        memo: object = None,
    ) -> InsertResult:
        """``PrefixCache.insert``, remembering which prefix each offered state checkpoints."""
        for p, slot in (states or {}).items():
            if p in self._plan:
                self._slot_key[slot] = self._plan[p]
        return super().insert(tokens, kv, states, input_len, memo)

    # -------------------------------------------------------------- eviction
    def next_use(self, node: Node) -> int:
        """The first request after ``now`` that wants ``node``'s state; ``NEVER`` if none."""
        if node.state is None:
            return NEVER
        uses = self.future.uses.get(self._slot_key.get(node.state, -1), ())
        k = bisect.bisect_right(uses, self.now)
        return uses[k] if k < len(uses) else NEVER

    def _candidate_info(self, node: Node) -> CandidateInfo:
        return super()._candidate_info(node)._replace(last_access=self.next_use(node))

    def evict(self, kv_slots: int = 0, state_slots: int = 0, nbytes: int = 0) -> EvictResult:
        """As ``PrefixCache.evict``; priorities depend on ``now``, so the first eviction of each
        request reorders all candidates (O(n) once per request that evicts)."""
        if self._fitted_at != self.now and not self._fits(kv_slots, state_slots, nbytes):
            self.index.rebuild()
            self._fitted_at = self.now
        return super().evict(kv_slots, state_slots, nbytes)


def simulate_oracle(
    trace: Sequence[Request],
    cost: CostModel | str,
    capacity_bytes: int,
    page_size: int = 1,
    *,
    profile: str = "a100",
    trace_name: str = "trace",
    match_rule: str = "last-token",
) -> SimResult:
    """Replay ``trace`` sequentially through an ``OracleCache`` of ``capacity_bytes`` (shared
    budget); the result has policy ``"oracle"`` and the same fields as ``simulate``'s.
    Raises ``ValueError`` for models without SSM layers (the oracle's admission is about states).
    """
    if isinstance(cost, str):
        cost = load_cost_model(cost)
    if not cost.has_ssm:
        raise ValueError(f"{cost.name}: the oracle needs a model with SSM layers")
    t0 = time.perf_counter()
    future = future_uses(trace, cost, page_size, match_rule=match_rule)
    budget = MemoryBudget.shared(capacity_bytes)
    cache = OracleCache(cost, budget, future, page_size, match_rule)
    rp = Replayer(cache, get_profile(profile))
    for i, req in enumerate(trace):
        cache.prepare(i, req)
        rp.serve(req)
    wall = time.perf_counter() - t0
    cache.check_integrity()
    return rp.result(
        trace=trace_name,
        policy="oracle",
        mode="sequential",
        capacity_bytes=capacity_bytes,
        alpha=None,
        states_admitted=cache.stats.states_admitted,
        wall_s=wall,
    )

"""``PrefixCache``: the one cache core used by the engine, the simulator and the SGLang plugin.

It owns the tree, the pools and the policies. Requests allocate their working memory through it
(``alloc_kv``, ``alloc_state``), which evicts first, so the budget holds at every instant, and
give it back by ``insert`` (the tree adopts what it keeps) or ``free_kv`` / ``free_state``.

Accounting, exact at every step (``check_integrity``), for each pool:
``free + cached (in tree, unlocked) + locked (in tree, pinned) + in_flight (held by requests)
== total``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from marconi.cache import (  # noqa: F401 - register the learned policies
    admission_learned,
    eviction_learned,
)
from marconi.cache.admission import (
    ADMISSION_POLICIES,
    AdmissionContext,
    AdmissionPolicy,
    PrefillPlan,
)
from marconi.cache.eviction import EVICTION_POLICIES, CandidateInfo, EvictionIndex
from marconi.cache.node import EvictResult, InsertResult, MatchResult, Node, SizeInfo
from marconi.cache.pools import MemoryBudget, make_pools
from marconi.cache.tree import RadixTree

if TYPE_CHECKING:
    from marconi.cache.eviction import EvictionPolicy


class CostLike(Protocol):
    """The part of ``marconi.cache.cost.CostModel`` the cache needs."""

    kv_bytes_per_token: int
    state_bytes: int

    @property
    def has_ssm(self) -> bool: ...

    def prefill_flops(self, end: int, start: int = 0) -> float: ...


@dataclass(frozen=True)
class CacheConfig:
    """Which policies a cache runs. Built from a named preset (``marconi.cache.presets``)."""

    admission: str = "marconi"
    admission_args: Mapping[str, object] = field(default_factory=dict)
    eviction: str = "flop-aware"
    alpha: float = 0.0  # FLOP-aware weight; tuned online when the preset asks for "auto"
    page_size: int = 1
    match_rule: str = "last-token"  # what a request may resume from (``marconi.cache.lease``)

    def make_admission(self) -> AdmissionPolicy:
        return ADMISSION_POLICIES.create(self.admission, **dict(self.admission_args))

    def make_eviction(self) -> EvictionPolicy:
        factory = EVICTION_POLICIES.get(self.eviction)
        kwargs = {"alpha": self.alpha} if getattr(factory, "has_alpha", False) else {}
        return factory(**kwargs)


@dataclass
class CacheStats:
    """Counters since creation (monotone)."""

    evicted_nodes: int = 0
    evicted_kv_slots: int = 0
    evicted_states: int = 0
    states_admitted: int = 0
    states_declined: int = 0
    alloc_failures: int = 0


class PrefixCache:
    """Hybrid prefix cache: radix tree + KV/state pools + admission and eviction policies."""

    def __init__(
        self,
        cost: CostLike,
        budget: MemoryBudget,
        config: CacheConfig | None = None,
    ) -> None:
        self.cost = cost
        self.budget = budget
        self.config = config or CacheConfig()
        self.page_size = self.config.page_size
        self.pools = make_pools(budget, cost.kv_bytes_per_token, cost.state_bytes, self.page_size)
        self.admission = self.config.make_admission()
        self.eviction = self.config.make_eviction()
        self.tree = RadixTree(self.pools, page_size=self.page_size, has_ssm=cost.has_ssm)
        self.index = EvictionIndex(self.tree, self.eviction, self._candidate_info)
        self.tree.on_change = self.index.changed
        self._listen()
        self.kv_in_flight = 0
        self.states_in_flight = 0
        self.stats = CacheStats()

    def _listen(self) -> None:
        """Feed hits to a learning eviction policy (evictions are fed by ``evict``)."""
        if self.eviction.learns:
            self.tree.on_hit = lambda node: self.eviction.record(
                self.index.info_of(node), self.tree.clock, True
            )

    # ------------------------------------------------------------------ lookups
    def match(self, tokens: np.ndarray) -> MatchResult:
        """See ``RadixTree.match``. Refreshes only the node it returns."""
        return self.tree.match(tokens)

    def usable_len(self, tokens: np.ndarray) -> int:
        """Read-only ``match(tokens).usable_len``. See ``RadixTree.usable_len``."""
        return self.tree.usable_len(tokens)

    def branch_point(self, tokens: np.ndarray) -> int | None:
        """Speculative insertion; read-only. See ``RadixTree.branch_point``."""
        return self.tree.branch_point(tokens)

    def plan_prefill(
        self, tokens: np.ndarray, match: MatchResult, key: np.ndarray | None = None
    ) -> PrefillPlan:
        """Positions where this request's prefill should capture a state (admission policy),
        and the memo its ``insert`` hands back to the admission. ``key``: the prefix of
        ``tokens`` that was matched (the match rule's key; default all of ``tokens``);
        speculative insertion runs on it, as SGLang computes its branching seqlen from the
        matched key (a branch past the key could serve no request with this input)."""
        if self.pools.state is None:
            return PrefillPlan(())
        key = tokens if key is None else key
        memo = None
        if self.admission.learns:
            memo = self.admission.observe_prefill(tokens, len(key), match.usable_len)
            self.eviction.observe_admission(self.admission)
        branch = self.branch_point(key)
        ctx = AdmissionContext(len(tokens), match.usable_len, branch)
        return PrefillPlan(self.admission.prefill_positions(ctx), memo)

    def plan_decode(self, input_len: int, seq_len: int) -> tuple[int, ...]:
        """Positions in the decoded continuation where a state should be captured."""
        if self.pools.state is None:
            return ()
        return self.admission.decode_positions(input_len, seq_len)

    def capture_points(self, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
        """Decode steps in ``[lo, hi)`` where a request copies its working state out (see
        ``AdmissionPolicy.capture_points``)."""
        if self.pools.state is None:
            return ()
        return self.admission.capture_points(input_len, lo, hi)

    # ------------------------------------------------------------------ locking
    def lock(self, node: Node) -> None:
        self.tree.lock(node)

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)

    # ------------------------------------------------------------------ request memory
    def alloc_kv(self, n: int) -> np.ndarray | None:
        """``n`` KV slots (pages when paged) for a request, evicting first; None if they cannot
        fit even after evicting every unlocked entry (nothing changes then but evictions)."""
        if self.pools.kv is None:
            raise RuntimeError("this model has no attention layers: there is no KV pool")
        if not self.evict(kv_slots=n).fits:
            self.stats.alloc_failures += 1
            return None
        slots = self.pools.kv.alloc(n)
        assert slots is not None
        self.kv_in_flight += n
        return slots

    def alloc_state(self) -> int | None:
        """One state slot for a request (a working slot or a checkpoint), evicting first."""
        if self.pools.state is None:
            raise RuntimeError("this model has no SSM layers: there is no state pool")
        if not self.evict(state_slots=1).fits:
            self.stats.alloc_failures += 1
            return None
        slot = self.pools.state.alloc_one()
        assert slot is not None
        self.states_in_flight += 1
        return slot

    def alloc_states(self, n: int) -> list[int]:
        """Up to ``n`` state slots in one eviction round: fewer (possibly none) if the budget
        cannot hold ``n`` even after evicting every unlocked entry."""
        if n <= 0:
            return []
        if self.pools.state is None:
            raise RuntimeError("this model has no SSM layers: there is no state pool")
        if not self.evict(state_slots=n).fits:
            self.stats.alloc_failures += 1
            while n and not self.pools.can_alloc(0, n):
                n -= 1
        slots = self.pools.state.alloc(n)
        assert slots is not None
        self.states_in_flight += n
        return slots.tolist()

    def free_kv(self, slots: np.ndarray) -> None:
        """Give back request-held KV slots that will not be inserted."""
        if len(slots):
            assert self.pools.kv is not None
            self.pools.kv.free(slots)
            self.kv_in_flight -= len(slots)

    def free_state(self, slot: int) -> None:
        assert self.pools.state is not None
        self.pools.state.free_one(slot)
        self.states_in_flight -= 1

    def insert(
        self,
        tokens: np.ndarray,
        kv: np.ndarray | None,
        states: Mapping[int, int] | None = None,
        input_len: int | None = None,
        memo: object = None,
    ) -> InsertResult:
        """Insert a finished (or paused) sequence; the request gives up ``kv`` and ``states``
        (see the ownership table of ``RadixTree.insert``). ``input_len`` (the request's prompt
        length, if known) lets a learning admission policy see what the request decoded;
        ``memo``: its ``plan_prefill``'s, if kept (``tokens`` start with that input)."""
        if input_len is not None and self.admission.learns and self.pools.state is not None:
            self.admission.observe_insert(tokens, input_len, memo)
        states = dict(states or {})
        result = self.tree.insert(tokens, kv, states)
        self.kv_in_flight -= 0 if kv is None else len(kv) - result.kv_reused
        self.states_in_flight -= len(states)
        self.stats.states_admitted += result.states_admitted
        self.stats.states_declined += result.states_declined
        return result

    # ------------------------------------------------------------------ eviction
    def evict(self, kv_slots: int = 0, state_slots: int = 0, nbytes: int = 0) -> EvictResult:
        """Evict in policy order until ``kv_slots`` KV slots, ``state_slots`` state slots and
        ``nbytes`` bytes (of the shared meter, or of every meter) can be allocated at once.
        ``evict()`` with no arguments does nothing. May evict more than asked (a leaf frees its
        whole edge). Never evicts locked entries."""
        freed = [0, 0, 0]
        skipped: list[Node] = []
        while not self._fits(kv_slots, state_slots, nbytes):
            node = self.index.pop()
            if node is None:
                break
            if not self._helps(node, kv_slots, state_slots, nbytes):
                skipped.append(node)
                continue
            if self.eviction.learns:
                self.eviction.record(self.index.info_of(node), self.tree.clock, False)
            for i, v in enumerate(self.tree.evict_node(node)):
                freed[i] += v
        for node in skipped:
            self.index.push_back(node)
        self.stats.evicted_kv_slots += freed[0]
        self.stats.evicted_states += freed[1]
        self.stats.evicted_nodes += freed[2]
        return EvictResult(*freed, fits=self._fits(kv_slots, state_slots, nbytes))

    def _fits(self, kv_slots: int, state_slots: int, nbytes: int) -> bool:
        if nbytes and any(m.free < nbytes for m in self.pools.meters):
            return False
        return self.pools.can_alloc(kv_slots, state_slots)

    def _helps(self, node: Node, kv_slots: int, state_slots: int, nbytes: int) -> bool:
        """Whether evicting ``node`` frees a resource that is short (always, with one meter)."""
        if self.budget.is_shared or nbytes:
            return True
        frees_kv = not node.children and node.kv is not None and len(node.kv) > 0
        frees_state = node.state is not None
        kv_short = (
            kv_slots > 0 and self.pools.kv is not None and not self.pools.kv.can_alloc(kv_slots)
        )
        state_short = (
            state_slots > 0
            and self.pools.state is not None
            and not self.pools.state.can_alloc(state_slots)
        )
        return (kv_short and frees_kv) or (state_short and frees_state)

    def set_alpha(self, alpha: float) -> None:
        """Change the FLOP-aware weight (alpha tuning); reorders the candidates."""
        if hasattr(self.eviction, "alpha"):
            self.eviction.alpha = float(alpha)  # type: ignore[attr-defined]
            self.index.rebuild()

    @property
    def alpha(self) -> float | None:
        return getattr(self.eviction, "alpha", None)

    def _candidate_info(self, node: Node) -> CandidateInfo:
        cost, policy = self.cost, self.eviction
        has_state = node.state is not None
        nbytes = cost.state_bytes if has_state else 0
        if not node.children and node.kv is not None and self.pools.kv is not None:
            nbytes += len(node.kv) * self.pools.kv.slot_bytes  # a leaf frees its edge's KV
        end = node.end
        hit_possible = has_state or not cost.has_ssm
        flops = 0.0
        if hit_possible and policy.needs_cost:
            flops = float(cost.prefill_flops(end, node.start))
        return CandidateInfo(
            node.last_access, nbytes, flops, policy.kind(node), end if hit_possible else 0
        )

    # ------------------------------------------------------------------ accounting
    def size_info(self) -> SizeInfo:
        kv_cached = kv_locked = st_cached = st_locked = 0
        for n in self.tree.iter_nodes():
            k = 0 if n.kv is None else len(n.kv)
            if n.lock:
                kv_locked += k
            else:
                kv_cached += k
            if n.state is not None:
                if n.ref:
                    st_locked += 1
                else:
                    st_cached += 1
        kv, st = self.pools.kv, self.pools.state
        return SizeInfo(
            kv_total=0 if kv is None else kv.num_slots,
            kv_free=0 if kv is None else kv.num_free,
            kv_cached=kv_cached,
            kv_locked=kv_locked,
            kv_in_flight=self.kv_in_flight,
            state_total=0 if st is None else st.num_slots,
            state_free=0 if st is None else st.num_free,
            state_cached=st_cached,
            state_locked=st_locked,
            state_in_flight=self.states_in_flight,
            used_bytes=self.pools.used_bytes,
            capacity_bytes=self.budget.capacity_bytes,
            nodes=len(self.tree.nodes),
        )

    def check_integrity(self, deep: bool = False) -> None:
        """Assert the tree's structure and that every slot is accounted for exactly once.
        ``deep`` also checks slot ids (no slot both free and cached, none cached twice)."""
        from marconi.cache.integrity import check_cache

        check_cache(self, deep=deep)


def clone_cache(cache: PrefixCache) -> PrefixCache:
    """An independent copy of ``cache`` (tree, pools, policies with their learned state, counters)
    for what-if replays
    (alpha tuning). Iterative, so deep trees do not hit the recursion limit. Slots only, no
    tensors (the cache core never has any). Locks are copied as they are."""
    import copy

    new = copy.copy(cache)
    new.pools = copy.deepcopy(cache.pools._replace(state=None, kv=None))
    meters = {id(m): c for m, c in zip(cache.pools.meters, new.pools.meters, strict=True)}
    kv = st = None
    if cache.pools.kv is not None:
        kv = copy.copy(cache.pools.kv)
        kv._recycled = cache.pools.kv._recycled.copy()
        kv.meter = meters[id(cache.pools.kv.meter)]
    if cache.pools.state is not None:
        st = copy.copy(cache.pools.state)
        st._recycled = cache.pools.state._recycled.copy()
        st.meter = meters[id(cache.pools.state.meter)]
    new.pools = new.pools._replace(kv=kv, state=st)
    new.eviction = copy.deepcopy(cache.eviction)
    if cache.admission.learns:  # a what-if replay must not teach the real cache's admission
        new.admission = copy.deepcopy(cache.admission)
    new.stats = copy.copy(cache.stats)
    tree = copy.copy(cache.tree)
    tree.pools = new.pools
    tree.root = _clone_subtree(cache.tree.root)
    tree.nodes = {}
    stack = list(tree.root.children.values())
    while stack:
        n = stack.pop()
        tree.nodes[n.id] = n
        stack.extend(n.children.values())
    new.tree = tree
    new.index = EvictionIndex(tree, new.eviction, new._candidate_info)
    tree.on_change = new.index.changed
    new._listen()
    new.index.rebuild(refit=False)
    new.index._pops_since_fit = cache.index._pops_since_fit
    return new


def _clone_subtree(root: Node) -> Node:
    """Copy a subtree node by node (keys/KV arrays are shared: edges are never written in place,
    only replaced)."""
    import copy

    new_root = copy.copy(root)
    new_root.children = {}
    stack = [(root, new_root)]
    while stack:
        old, new = stack.pop()
        for key, child in old.children.items():
            c = copy.copy(child)
            c.children = {}
            c.parent = new
            new.children[key] = c
            stack.append((child, c))
    return new_root

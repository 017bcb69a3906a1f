"""Eviction policies (strategy classes from a registry) and the index that orders candidates.

A policy turns a candidate's ``CandidateInfo`` into a priority (lowest evicted first). The
``EvictionIndex`` keeps a lazy min-heap of ``(priority, node)``: a node's entry is pushed again
whenever it changes, and stale entries are skipped on pop, so one eviction costs O(log n).
Policies that normalise their terms over the candidate set (FLOP-aware) are refit once per epoch
(after about half the candidates have been evicted, or when their parameters change), never after
every single eviction: amortised O(log n) per eviction.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from marconi.registry import Registry

if TYPE_CHECKING:
    from marconi.cache.admission import AdmissionPolicy
    from marconi.cache.node import Node
    from marconi.cache.tree import RadixTree


class CandidateInfo(NamedTuple):
    """What a policy may look at: recency, and what evicting the node frees and costs."""

    last_access: int
    bytes_freed: int
    flops_lost: float  # prefill FLOPs a future hit on this node would have saved
    kind: int = 0  # a class id, for policies that learn per class (``EvictionPolicy.describe``)
    tokens: int = 0  # prefix tokens a hit on this node gives (0: it cannot be hit)

    @property
    def flop_efficiency(self) -> float:
        return self.flops_lost / self.bytes_freed if self.bytes_freed else 0.0


class EvictionPolicy(ABC):
    """Orders eviction candidates. Contract: ``priority`` is a pure function of the info and of
    the state set by the last ``fit``; lower priority is evicted first."""

    name: ClassVar[str]
    #: whether single-child nodes holding a state are candidates (they give up only the state)
    single_child: ClassVar[bool] = False
    #: whether priorities depend on the candidate set (then the index refits once per epoch)
    needs_fit: ClassVar[bool] = False
    #: whether ``priority`` reads bytes and FLOPs (else only ``last_access`` is filled in)
    needs_cost: ClassVar[bool] = True
    #: whether the policy learns from hits and evictions (then the cache calls ``record``)
    learns: ClassVar[bool] = False
    #: refit after this fraction of the nodes has been popped (``needs_fit`` policies)
    refit_fraction: ClassVar[float] = 0.5
    #: whether the policy takes a tunable weight ``alpha`` (then tuners search ``alpha_grid``)
    has_alpha: ClassVar[bool] = False
    alpha_grid: ClassVar[tuple[float, ...]] = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)

    def kind(self, node: Node) -> int:
        """The class of a candidate, for policies that learn per class (``CandidateInfo.kind``)."""
        return 0

    def record(self, info: CandidateInfo, now: int, hit: bool) -> None:  # noqa: B027 - optional
        """A node described by ``info`` was hit (``hit``) or evicted at clock ``now``."""

    def observe_admission(self, admission: AdmissionPolicy) -> None:  # noqa: B027 - optional
        """The cache's admission policy has just seen a request's prefill (called after every
        ``AdmissionPolicy.observe_prefill``), so a policy may follow what it learned."""

    @property
    def alpha_hold(self) -> float | None:
        """An alpha the tuner must keep for now instead of searching (None: tune)."""
        return None

    def stale(self, now: int) -> bool:
        """Whether priorities computed at the last ``fit`` are outdated at clock ``now`` (for
        policies whose priorities change with age); the index then refits before popping."""
        return False

    def fit(self, infos: Sequence[CandidateInfo]) -> None:  # noqa: B027 - optional hook
        """Refit normalisers over the current candidates (called once per epoch)."""

    @abstractmethod
    def priority(self, info: CandidateInfo) -> float: ...


EVICTION_POLICIES: Registry[EvictionPolicy] = Registry("eviction policy")


@EVICTION_POLICIES.register("lru")
class LRU(EvictionPolicy):
    """Least recently used leaf first (the SGLang+ baseline of the paper)."""

    name = "lru"
    needs_cost = False

    def priority(self, info: CandidateInfo) -> float:
        return float(info.last_access)


@EVICTION_POLICIES.register("flop-aware")
class FlopAware(EvictionPolicy):
    """Marconi: ``S(n) = recency(n) + alpha * flop_efficiency(n)``, both min-max normalised over
    the candidates; leaves and single-child nodes are candidates. ``alpha = 0`` is LRU over the
    same candidates."""

    name = "flop-aware"
    single_child = True
    needs_fit = True
    has_alpha = True

    def __init__(self, alpha: float = 0.0) -> None:
        self.alpha = float(alpha)
        self._t0, self._t_span, self._e0, self._e_span = 0.0, 1.0, 0.0, 1.0

    def fit(self, infos: Sequence[CandidateInfo]) -> None:
        if not infos:
            return
        times = [i.last_access for i in infos]
        effs = [i.flop_efficiency for i in infos]
        self._t0, self._t_span = min(times), max(max(times) - min(times), 1)
        self._e0, self._e_span = min(effs), max(effs) - min(effs) or 1.0

    def priority(self, info: CandidateInfo) -> float:
        recency = (info.last_access - self._t0) / self._t_span
        return recency + self.alpha * (info.flop_efficiency - self._e0) / self._e_span


class EvictionIndex:
    """Lazy min-heap of eviction candidates for one tree and one policy."""

    def __init__(
        self,
        tree: RadixTree,
        policy: EvictionPolicy,
        info: Callable[[Node], CandidateInfo],
    ) -> None:
        self.tree = tree
        self.policy = policy
        self.info = info
        self._heap: list[tuple[float, int, int, Node]] = []
        self._seq = itertools.count()
        self._pops_since_fit = 0

    def changed(self, node: Node) -> None:
        """Invalidate ``node``'s entries and push a fresh one if it is a candidate now."""
        node.version += 1
        if self.tree.is_candidate(node, self.policy.single_child):
            if self.policy.needs_cost or self.policy.learns:
                info = self.info(node)
                node.info = (node.version, info)  # valid until the node changes again
            else:
                info = CandidateInfo(node.last_access, 0, 0)
            prio = self.policy.priority(info)
            heapq.heappush(self._heap, (prio, next(self._seq), node.version, node))
            if len(self._heap) > 4 * len(self.tree.nodes) + 1024:
                self.rebuild()

    @staticmethod
    def memo(node: Node) -> CandidateInfo | None:
        """The info ``changed`` left on ``node``, if the node has not changed since (the tree
        reports every change of a candidate's inputs: ``RadixTree.on_change``)."""
        memo = node.info
        return memo[1] if memo is not None and memo[0] == node.version else None

    def info_of(self, node: Node) -> CandidateInfo:
        """``info(node)``, from its ``memo`` when there is one."""
        info = self.memo(node)
        return self.info(node) if info is None else info

    def rebuild(self, refit: bool = True) -> None:
        """Refit the policy over all current candidates and rebuild the heap (drops stale
        entries). O(n); called once per epoch. ``refit=False`` keeps the policy's fitted state
        (a clone's index: it must rank as the cache it copies does)."""
        single, is_candidate = self.policy.single_child, self.tree.is_candidate
        cands = [n for n in self.tree.iter_nodes() if is_candidate(n, single)]
        infos = [self.info_of(n) for n in cands]
        if refit:
            self.policy.fit(infos)
        self._heap = [
            (self.policy.priority(i), next(self._seq), n.version, n)
            for n, i in zip(cands, infos, strict=True)
        ]
        heapq.heapify(self._heap)
        self._pops_since_fit = 0

    def pop(self) -> Node | None:
        """The lowest-priority evictable node (removed from the heap), or None."""
        refit = max(16, int(len(self.tree.nodes) * self.policy.refit_fraction))
        if self.policy.needs_fit and (
            self._pops_since_fit > refit or self.policy.stale(self.tree.clock)
        ):
            self.rebuild()
        single = self.policy.single_child
        while self._heap:
            _, _, version, node = heapq.heappop(self._heap)
            if node.version == version and self.tree.is_candidate(node, single):
                self._pops_since_fit += 1
                return node
        return None

    def push_back(self, node: Node) -> None:
        """Return a popped node that the caller decided not to evict."""
        self.changed(node)

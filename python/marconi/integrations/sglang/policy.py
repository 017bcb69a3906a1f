"""Marconi's admission and eviction decisions, expressed on SGLang's tree nodes.

No SGLang import: a node is anything with ``parent``, ``children``, ``key`` (sized) and
``last_access_time``, which is what SGLang's ``UnifiedTreeNode`` has. The decisions themselves
come from ``marconi.cache`` (``MarconiAdmission``, ``FlopAware``, ``CostModel``): this module
only translates SGLang's view of a request and a node into their inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from marconi.cache.admission import ADMISSION_POLICIES, AdmissionContext, AdmissionPolicy
from marconi.cache.cost import CostModel
from marconi.cache.eviction import EVICTION_POLICIES, CandidateInfo, EvictionPolicy

logger = logging.getLogger(__name__)


class TreeNodeLike(Protocol):
    """The part of SGLang's ``UnifiedTreeNode`` the policy reads."""

    parent: Any
    children: dict[Any, Any]
    key: Any
    last_access_time: float


@dataclass
class MarconiStats:
    """Counters the backend logs (``summary()``) and tests read."""

    states_admitted: int = 0  # states handed to the tree
    states_declined: int = 0  # states SGLang would have cached but Marconi's admission skipped
    branch_states: int = 0  # admitted at a branch point (purely-input reuse)
    decode_states: int = 0  # admitted after the last decoded token (input-and-output reuse)
    states_reused: int = 0  # matches that resumed from a cached state
    hit_tokens: int = 0  # tokens served from the cache (state-backed prefix)
    query_tokens: int = 0  # tokens looked up
    kv_evictions: int = 0  # leaves evicted by the Full (KV) component
    state_evictions: int = 0  # states evicted by the Mamba component
    alpha: float = 0.0
    _log_every: int = field(default=100, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def summary(self) -> str:
        return (
            f"marconi: hit_tokens={self.hit_tokens}/{self.query_tokens} "
            f"({100 * self.hit_rate:.1f}%) states admitted={self.states_admitted} "
            f"(branch={self.branch_states} decode={self.decode_states}) "
            f"declined={self.states_declined} reused={self.states_reused} "
            f"evicted kv_leaves={self.kv_evictions} states={self.state_evictions} "
            f"alpha={self.alpha:g}"
        )


def node_depth(node: TreeNodeLike) -> int:
    """Tokens from the root to the end of ``node`` (O(depth))."""
    depth = 0
    while node is not None and node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


class MarconiPolicy:
    """Admission (branch point + last decoded token) and FLOP-aware ordering for one cache.

    ``admission``/``eviction`` are names in ``ADMISSION_POLICIES``/``EVICTION_POLICIES``
    (default ``marconi``/``flop-aware``); ``cost`` is the served model's cost model.
    """

    def __init__(
        self,
        cost: CostModel,
        alpha: float = 1.0,
        admission: str = "marconi",
        eviction: str = "flop-aware",
    ) -> None:
        self.cost = cost
        self.admission: AdmissionPolicy = ADMISSION_POLICIES.create(admission)
        kwargs = {"alpha": alpha} if eviction == "flop-aware" else {}
        self.eviction: EvictionPolicy = EVICTION_POLICIES.create(eviction, **kwargs)
        self.stats = MarconiStats(alpha=float(alpha))
        self._events = 0

    @property
    def alpha(self) -> float:
        """The FLOP-aware weight (0.0 for a policy without one)."""
        return float(getattr(self.eviction, "alpha", 0.0))

    def set_alpha(self, alpha: float) -> None:
        """Change the FLOP-aware weight (alpha tuning). Nothing else to reorder: the backend's
        components build their eviction order at the start of each eviction walk."""
        if hasattr(self.eviction, "alpha"):
            self.eviction.alpha = float(alpha)  # type: ignore[attr-defined]
            self.stats.alpha = float(alpha)

    # ------------------------------------------------------------------ admission
    def wanted_positions(
        self,
        input_len: int,
        usable_len: int,
        branch_point: int | None,
        seq_len: int,
        is_finished: bool,
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prefill positions, decode positions) the admission policy checkpoints."""
        ctx = AdmissionContext(input_len, usable_len, branch_point)
        prefill = self.admission.prefill_positions(ctx)
        decode = self.admission.decode_positions(input_len, seq_len) if is_finished else ()
        return prefill, decode

    def admits(
        self,
        cache_len: int,
        input_len: int,
        usable_len: int,
        branch_point: int | None,
        seq_len: int,
        is_finished: bool,
    ) -> bool:
        """Whether the state SGLang holds at ``cache_len`` is one Marconi keeps.

        A prefill state is kept only at the branch point (exactly). A finished request's state
        stands for "after the last decoded token" when it lies in the output (``> input_len``):
        SGLang holds one state per request, the latest it computed (exact in ``no_buffer`` mode,
        the last ``--mamba-track-interval`` boundary in ``extra_buffer`` mode). Counts the
        decision in ``stats``.
        """
        prefill, decode = self.wanted_positions(
            input_len, usable_len, branch_point, seq_len, is_finished
        )
        if cache_len in prefill:
            self.stats.branch_states += 1
            ok = True
        elif decode and cache_len > input_len:
            self.stats.decode_states += 1
            ok = True
        else:
            ok = False
        if ok:
            self.stats.states_admitted += 1
        else:
            self.stats.states_declined += 1
        self._tick()
        return ok

    def record_match(self, query_len: int, hit_len: int, reused_state: bool) -> None:
        self.stats.query_tokens += query_len
        self.stats.hit_tokens += hit_len
        self.stats.states_reused += int(reused_state)

    # ------------------------------------------------------------------ eviction
    def candidate_info(self, node: TreeNodeLike, holds_state: bool, is_leaf: bool) -> CandidateInfo:
        """``CandidateInfo`` of an SGLang node, as ``PrefixCache`` builds it for its own nodes:
        a leaf frees its edge's KV and its state, a single-child node only its state; a hit on
        it would have saved the prefill FLOPs of its edge."""
        end = node_depth(node)
        start = end - len(node.key)
        state_bytes = self.cost.state_bytes if holds_state else 0
        nbytes = state_bytes + (self.cost.kv_bytes_per_token * (end - start) if is_leaf else 0)
        hit_possible = holds_state or not self.cost.has_ssm
        flops = self.cost.prefill_flops(end, start) if hit_possible else 0.0
        return CandidateInfo(int(node.last_access_time), nbytes, float(flops))

    def order(self, infos: Sequence[CandidateInfo]) -> list[int]:
        """Indices of ``infos`` in eviction order (lowest priority first); refits the policy's
        normalisers over exactly these candidates."""
        self.eviction.fit(infos)
        prio = [self.eviction.priority(i) for i in infos]
        return sorted(range(len(infos)), key=lambda i: (prio[i], infos[i].last_access))

    def _tick(self) -> None:
        self._events += 1
        if self._events % self.stats._log_every == 0:
            logger.info(self.stats.summary())

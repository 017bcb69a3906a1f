"""Marconi's admission and eviction decisions, expressed on SGLang's tree nodes and requests.

No SGLang import: a node is anything with ``parent``, ``children``, ``key`` (sized) and
``last_access_time``, which is what SGLang's ``UnifiedTreeNode`` has. The decisions themselves
come from the classes of a ``marconi.cache`` preset (admission, eviction, ``CostModel``), built
as ``PrefixCache`` builds them: this module only translates SGLang's view of a request and a
node into their inputs, and feeds them in the order ``marconi.cache.lease.Leases`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from marconi.cache.admission import AdmissionContext, AdmissionPolicy
from marconi.cache.cost import CostModel
from marconi.cache.eviction import CandidateInfo, EvictionPolicy
from marconi.cache.eviction_learned import class_of

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
    branch_states: int = 0  # admitted at a planned prefill position (branch point, prompt end..)
    decode_states: int = 0  # admitted at finish (a decode position: the last decoded token)
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
            f"(prefill={self.branch_states} decode={self.decode_states}) "
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


class RequestPlan(NamedTuple):
    """What the admission planned for one request when it was first scheduled (as
    ``Leases.begin`` plans on the tree as matched): its input length and the prefill positions
    whose states the tree keeps. Stored on the SGLang ``Req`` (``PLAN_ATTR``)."""

    input_len: int
    prefill: tuple[int, ...]
    memo: object = None  # the admission's (``observe_prefill``), handed to ``finished``


#: attribute of an SGLang ``Req`` holding its ``RequestPlan``
PLAN_ATTR = "marconi_plan"
#: attributes of an SGLang tree node the policy keeps: its access time on the policy's clock
#: (one tick per planned request and per insert, as ``RadixTree.clock``) and its hits
ACCESS_ATTR, HITS_ATTR = "marconi_access", "hits"


class MarconiPolicy:
    """The admission and eviction of a ``marconi.cache`` preset, fed as ``Leases`` feeds them.

    ``preset``: a name in ``marconi.cache.presets.PRESETS`` (``marconi``: learned admission +
    hit-density eviction; ``marconi-paper``: branch point + last decoded, FLOP-aware); its
    admission and eviction classes are built exactly as ``PrefixCache`` builds them. The order of
    the calls is the lifecycle's: ``plan`` at a request's first scheduling (``observe_prefill``,
    then ``prefill_positions``), ``admits`` at every state SGLang offers, ``finished`` after the
    final insert (``observe_insert``); hits and evictions feed a learning eviction policy.
    """

    def __init__(self, cost: CostModel, alpha: float = 0.0, preset: str = "marconi") -> None:
        from marconi.cache.presets import preset_config

        self.cost = cost
        self.preset = preset
        config = preset_config(preset, alpha=alpha)
        self.admission: AdmissionPolicy = config.make_admission()
        self.eviction: EvictionPolicy = config.make_eviction()
        self.stats = MarconiStats(alpha=float(alpha))
        self.clock = 0
        self._events = 0

    @property
    def alpha(self) -> float:
        """The eviction's value weight (0.0 for a policy without one)."""
        return float(getattr(self.eviction, "alpha", 0.0))

    def set_alpha(self, alpha: float) -> None:
        """Change the value weight (alpha tuning). Nothing else to reorder: the backend's
        components build their eviction order at the start of each eviction walk."""
        if hasattr(self.eviction, "alpha"):
            self.eviction.alpha = float(alpha)  # type: ignore[attr-defined]
            self.stats.alpha = float(alpha)

    # ------------------------------------------------------------------ admission
    def plan(
        self,
        tokens: np.ndarray,
        usable_len: int,
        branch_point: int | None,
        used: TreeNodeLike | None,
    ) -> RequestPlan:
        """A request with input ``tokens`` is scheduled: it resumes from ``usable_len``
        (the state at the end of ``used``; None for none) and branches off the tree at
        ``branch_point``. One tick of the clock, the hit recorded (before the node's access
        time moves, as ``RadixTree.match``), then the plan."""
        self.clock += 1
        self.record_match(max(len(tokens) - 1, 0), usable_len, usable_len > 0)
        if used is not None and usable_len > 0:
            if self.eviction.learns:
                info = self.candidate_info(used, holds_state=True, is_leaf=not used.children)
                self.eviction.record(info, self.clock, True)
            self.touch(used)
            setattr(used, HITS_ATTR, getattr(used, HITS_ATTR, 0) + 1)
        memo = None
        if self.admission.learns:
            # SGLang's match key: the input but its last token (``names.SGLANG_MATCH_RULE``)
            memo = self.admission.observe_prefill(tokens, len(tokens) - 1, usable_len)
            self.eviction.observe_admission(self.admission)
        ctx = AdmissionContext(len(tokens), usable_len, branch_point)
        return RequestPlan(len(tokens), self.admission.prefill_positions(ctx), memo)

    def admits(self, plan: RequestPlan, cache_len: int, seq_len: int, is_finished: bool,
               exact: bool = True) -> bool:  # fmt: skip
        """Whether the state SGLang holds at ``cache_len`` is one the plan keeps: a planned
        prefill position, or (a finished request with ``seq_len`` fed tokens) a planned decode
        position. ``exact`` False (``extra_buffer``: SGLang holds the last tracked state, not
        the state at ``seq_len``): a finished request's state past the input stands for the
        decode state. Counts the decision in ``stats``."""
        decode = self.admission.decode_positions(plan.input_len, seq_len) if is_finished else ()
        if cache_len in plan.prefill:
            self.stats.branch_states += 1
            ok = True
        elif cache_len in decode or (not exact and decode and cache_len > plan.input_len):
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

    def inserted(self, node: TreeNodeLike | None) -> None:
        """An insert ended at ``node`` (one tick; its access time is now)."""
        self.clock += 1
        if node is not None and node.parent is not None:
            self.touch(node)

    def finished(self, fed: np.ndarray, input_len: int, memo: object = None) -> None:
        """A finished request's fed tokens went to the tree (``PrefixCache.insert``'s hook);
        ``memo``: its ``RequestPlan``'s."""
        if self.admission.learns:
            self.admission.observe_insert(fed, input_len, memo)

    def touch(self, node: TreeNodeLike) -> None:
        setattr(node, ACCESS_ATTR, self.clock)

    def evicted(self, node: TreeNodeLike, holds_state: bool) -> None:
        """``node`` is evicted (a learning eviction policy records the lifetime)."""
        if self.eviction.learns:
            info = self.candidate_info(node, holds_state, is_leaf=not node.children)
            self.eviction.record(info, self.clock, False)

    def record_match(self, query_len: int, hit_len: int, reused_state: bool) -> None:
        self.stats.query_tokens += query_len
        self.stats.hit_tokens += hit_len
        self.stats.states_reused += int(reused_state)

    # ------------------------------------------------------------------ eviction
    def candidate_info(self, node: TreeNodeLike, holds_state: bool, is_leaf: bool) -> CandidateInfo:
        """``CandidateInfo`` of an SGLang node, as ``PrefixCache`` builds it for its own nodes:
        a leaf frees its edge's KV and its state, a single-child node only its state; a hit on
        it would have saved the prefill FLOPs of its edge and given its whole prefix. Access
        time: the policy's clock for a learning eviction, else SGLang's ``last_access_time``."""
        end = node_depth(node)
        start = end - len(node.key)
        state_bytes = self.cost.state_bytes if holds_state else 0
        nbytes = state_bytes + (self.cost.kv_bytes_per_token * (end - start) if is_leaf else 0)
        hit_possible = holds_state or not self.cost.has_ssm
        flops = 0.0
        if hit_possible and self.eviction.needs_cost:
            flops = float(self.cost.prefill_flops(end, start))
        if self.eviction.learns:  # ages on the policy's clock, as the histograms were filled
            access, kind = (
                getattr(node, ACCESS_ATTR, 0),
                class_of(is_leaf, getattr(node, HITS_ATTR, 0)),
            )
        else:
            access, kind = int(node.last_access_time), 0
        return CandidateInfo(int(access), nbytes, flops, kind, end if hit_possible else 0)

    def order(self, infos: Sequence[CandidateInfo]) -> list[int]:
        """Indices of ``infos`` in eviction order (lowest priority first); refits the policy's
        normalisers over exactly these candidates."""
        self.eviction.fit(infos)
        prio = [self.eviction.priority(i) for i in infos]
        return sorted(range(len(infos)), key=lambda i: (prio[i], infos[i].last_access))

    def _tick(self) -> None:
        self._events += 1
        if self._events % self.stats._log_every == 0:
            enabled = getattr(self.admission, "enabled", None)  # the learned admission's kinds
            kinds = (
                ""
                if enabled is None
                else " kinds=" + ",".join(sorted(k.name.lower() for k in enabled))
            )
            logger.info(self.stats.summary() + kinds)

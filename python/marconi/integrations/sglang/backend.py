"""The ``marconi`` radix-cache backend for SGLang 0.5.23.

SGLang's ``UnifiedRadixCache`` with two components swapped in through its own
``component_registry_override`` hook; the tree, pools, locks and integrity checks stay SGLang's.
The decisions are a ``marconi.cache`` preset's (``--marconi-preset``, default ``marconi``:
learned admission + hit-density eviction; ``marconi-paper``: the paper's), made through
``MarconiPolicy`` in the order of the lease lifecycle (``marconi.cache.lease``):

- plan (``MarconiRadixCache.plan_request``, once per request when its prefill is first
  scheduled, on its latest match): the admission observes the request and plans its prefill
  states; ``branch_split``'s hooks end prefill chunks at the planned positions.
- admission (``MarconiMambaComponent.prepare_for_caching_req``): SGLang hands the tree a state
  at every prefill-chunk end (``no_buffer``) or tracked state (``extra_buffer``), and at finish;
  it is kept only where the plan (prefill) or the admission's decode positions (finish) put one.
- finish (``checkpoint_into_tree`` of a finished request): the admission observes the fed tokens
  (``PrefixCache.insert``'s hook), the alpha tuner gets the request.
- state eviction (``MarconiMambaComponent``): SGLang walks its Mamba LRU list; Marconi orders
  leaves and single-child state holders by the preset's eviction priority (multi-child holders
  last). KV eviction (``MarconiFullComponent``): SGLang's leaf heap, keyed by the same priority.
  A learning eviction records every hit (at plan) and eviction on the policy's clock.

Contracts kept from SGLang: an insert always carries a state at its end (so a declined state
means the request's KV is not inserted at that checkpoint: it stays the request's, as in SGLang's
own "no tracked state" path); eviction never touches locked data; a walk returns a leaf for the
controller to delete or tombstones one internal state per step. Not supported with the backend
(rejected at construction): HiCache, session radix cache, int8 Mamba checkpoints.

The cost model comes from the served model's HF config through the layer specs
(``marconi.cache.spec``), in the dtypes of SGLang's own pools (``cost_model_for``). Match rule:
SGLang's own, which is our last-token rule (``names.SGLANG_MATCH_RULE``). With
``--marconi-alpha auto`` (the default) ``BackendAlphaTuner`` (``tuning.py``) is fed every finished
request and moves the policy's value weight.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType, EvictLayer
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from marconi.cache.cost import CostModel, cost_model_from_hf_config
from marconi.cache.spec import CacheDtypes
from marconi.integrations.sglang.names import ALPHA_ENV, BACKEND_NAME, PRESET_ENV, SGLANG_PRESETS
from marconi.integrations.sglang.policy import PLAN_ATTR, MarconiPolicy, RequestPlan
from marconi.integrations.sglang.tuning import AUTO_ALPHA_START, BackendAlphaTuner
from marconi.units import parse_alpha

if TYPE_CHECKING:
    import torch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

logger = logging.getLogger(__name__)

__all__ = ["BACKEND_NAME", "MarconiRadixCache", "marconi_cache_factory"]


#: per-request attributes: the latest match (usable prefix, the node resumed from) and
#: whether the state of the checkpoint in progress was admitted
_MATCH_ATTR, _ADMITTED_ATTR = "marconi_match", "marconi_admitted"


def _policy(component: Any) -> MarconiPolicy:
    return component.cache.marconi


class MarconiFullComponent(FullComponent):
    """Full (KV) component whose eviction heap is ordered by Marconi's FLOP-aware score."""

    def __init__(self, cache: MarconiRadixCache, params: CacheInitParams) -> None:
        super().__init__(cache, params)
        # FullComponent keys its leaf heap by this callable (node -> priority).
        self.session_ref_eviction_strategy = self._marconi_priority

    def _marconi_info(self, node: Any) -> Any:
        mamba = node.component_data[ComponentType.MAMBA]
        holds_state = ComponentType.MAMBA in self.cache.components and mamba.value is not None
        return _policy(self).candidate_info(node, holds_state=holds_state, is_leaf=True)

    def _marconi_priority(self, node: Any) -> tuple[float, float]:
        policy = _policy(self)
        return (policy.eviction.priority(self._marconi_info(node)), node.last_access_time)

    def _evict_device_start(self, request_cnt: int) -> None:
        # Refit the normalisers over this walk's candidates (one epoch per eviction call).
        leaves = list(self.tree_core.evictable_device_leaves)
        _policy(self).eviction.fit([self._marconi_info(n) for n in leaves])
        super()._evict_device_start(request_cnt)

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        node_id = super()._evict_device_next_node(tracker, device_frees, host_frees, cache_actions)
        if node_id is not None:
            policy, node = _policy(self), self._evict_device_last_node
            policy.stats.kv_evictions += 1
            mamba = node.component_data[ComponentType.MAMBA]
            holds_state = ComponentType.MAMBA in self.cache.components and mamba.value is not None
            policy.evicted(node, holds_state=holds_state)
        return node_id


class MarconiMambaComponent(MambaComponent):
    """Mamba component with Marconi's admission and FLOP-aware state eviction."""

    # ------------------------------------------------------------------ admission
    def _held_state_len(self, req: Req, token_ids_len: int, is_finished: bool) -> int | None:
        """Position of the state SGLang would hand to the tree (None: none)."""
        if not self.cache.enable_mamba_extra_buffer:
            return token_ids_len
        if is_finished:
            checkpoint = self._select_finished_checkpoint(req, token_ids_len)
            return None if checkpoint is None else checkpoint[0]
        return req.kv.mamba_last_track_seqlen

    def prepare_for_caching_req(
        self,
        req: Req,
        insert_params: InsertParams,
        token_ids_len: int,
        is_finished: bool,
    ) -> int | None:
        """Hand SGLang's state to the tree only where Marconi admits it; else return 0, which
        makes the checkpoint insert nothing (the request keeps its KV and state)."""
        cache_len = self._held_state_len(req, token_ids_len, is_finished)
        admitted = False
        if cache_len:
            admitted = _policy(self).admits(
                self.cache.plan_request(req),
                cache_len=cache_len,
                seq_len=token_ids_len,
                is_finished=is_finished,
                exact=not self.cache.enable_mamba_extra_buffer,
            )
        setattr(req, _ADMITTED_ATTR, admitted)
        if not admitted:
            return 0
        return super().prepare_for_caching_req(req, insert_params, token_ids_len, is_finished)

    # ------------------------------------------------------------------ eviction
    def _evict_device_start(self, request_cnt: int) -> None:
        """Order this walk's victims: candidates (leaves and single-child holders, as in
        Marconi) by FLOP-aware priority, then multi-child holders in LRU order so that an
        allocation SGLang must satisfy still finds a state to evict."""
        ct = self.component_type
        self._evict_device_request_cnt = request_cnt
        lru = self.tree_core.lru_lists[ct]
        holders, node = [], lru.get_lru_no_lock()
        while node is not None:  # unlocked state holders, least recently used first
            holders.append(node)
            node = lru.get_prev_no_lock(node)
        cands = [n for n in holders if len(n.children) <= 1]
        rest = [n for n in holders if len(n.children) > 1]
        policy = _policy(self)
        infos = [policy.candidate_info(n, holds_state=True, is_leaf=not n.children) for n in cands]
        order = policy.order(infos)
        self._marconi_queue = deque([cands[i] for i in order] + rest)

    def _evict_device_next_node(self, tracker, device_frees, host_frees, cache_actions):
        """One step: return a leaf for the controller to delete, or tombstone one internal
        state here (then return None, as SGLang's walk does)."""
        ct = self.component_type
        lru = self.tree_core.lru_lists[ct]
        if tracker[ct] >= self._evict_device_request_cnt:
            return None
        while self._marconi_queue:
            x = self._marconi_queue.popleft()
            cd = x.component_data[ct]
            if not lru.in_list(x) or cd.value is None or cd.lock_ref > 0:
                continue  # changed since the walk started
            _policy(self).stats.state_evictions += 1
            _policy(self).evicted(x, holds_state=True)
            if x in self.tree_core.evictable_device_leaves:
                return x.id
            self.tree_core._evict_component_and_detach_lru(
                x,
                self,
                target=EvictLayer.DEVICE,
                tracker=tracker,
                device_frees=device_frees,
                host_frees=host_frees,
                cache_actions=cache_actions,
            )
            self.tree_core._cascade_evict(
                x,
                self,
                tracker,
                device_frees=device_frees,
                host_frees=host_frees,
                cache_actions=cache_actions,
            )
            return None
        return None

    def _evict_device_end(self) -> None:
        self._marconi_queue = deque()


class MarconiRadixCache(UnifiedRadixCache):
    """``UnifiedRadixCache`` with Marconi's components. ``marconi`` carries the policies, the
    cost model and the stats (``marconi.stats``, logged every 100 admission decisions).
    ``tune_alpha``: feed a ``BackendAlphaTuner`` (``marconi_tuner``) with finished requests."""

    def __init__(
        self, params: CacheInitParams, marconi: MarconiPolicy, tune_alpha: bool = False
    ) -> None:
        if params.enable_session_radix_cache:
            raise ValueError("--prefix-cache marconi does not support the session radix cache")
        if getattr(params.req_to_token_pool, "mamba_ckpt_pool", None) is not None:
            raise ValueError("--prefix-cache marconi does not support int8 Mamba checkpoints")
        self.marconi = marconi
        params.component_registry_override = {
            **(params.component_registry_override or {}),
            ComponentType.FULL: MarconiFullComponent,
            ComponentType.MAMBA: MarconiMambaComponent,
        }
        params.tree_core_backend = "python"  # the components read Python tree nodes
        super().__init__(params)
        self.marconi_tuner: BackendAlphaTuner | None = None
        if tune_alpha:
            mamba_pool = getattr(params.req_to_token_pool, "mamba_pool", None)
            self.marconi_tuner = BackendAlphaTuner(
                marconi,
                kv_slots=params.token_to_kv_pool_allocator.size,
                state_slots=mamba_pool.size if mamba_pool is not None else 0,
                page_size=params.page_size,
            )
        logger.info(
            "marconi backend: preset %s, %s, alpha=%s",
            marconi.preset,
            marconi.cost.describe(),
            "auto" if tune_alpha else f"{marconi.alpha:g}",
        )

    def init_hicache(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("--prefix-cache marconi does not support HiCache")

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """SGLang's match; the request's latest match is kept for its plan (``plan_request``):
        SGLang matches a waiting request again every scheduling round, the plan uses the one
        just before its prefill is scheduled."""
        result = super().match_prefix(params)
        if params.req is not None:
            node = result.last_device_node if result.device_prefix_len else None
            node = None if node is None else self.resolve_node_handle(node)
            setattr(params.req, _MATCH_ATTR, (result.device_prefix_len, node))
        return result

    def plan_request(self, req: Req) -> RequestPlan:
        """The request's admission plan, made once, when its prefill is first scheduled (the
        ``PrefillAdder`` hooks of ``branch_split`` call this; a checkpoint of a request that
        never went through them plans here), on its latest match: ``Leases.begin``'s
        ``plan_prefill``."""
        plan = getattr(req, PLAN_ATTR, None)
        if plan is None:
            usable, node = getattr(req, _MATCH_ATTR, (0, None))
            tokens = np.asarray(req.origin_input_ids, dtype=np.int64)
            branch = getattr(req, "mamba_branching_seqlen", None)
            plan = self.marconi.plan(tokens, usable, branch, node)
            setattr(req, PLAN_ATTR, plan)
        return plan

    def checkpoint_into_tree(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        """SGLang's insert. An admitted state moves the policy's clock and stamps the node the
        insert ended on; a finished request is then observed by the admission (its fed tokens)
        and fed to the alpha tuner (its prompt and the tokens it computed, ``[0, up_to)`` =
        prompt + output[:-1])."""
        finished = req.finished()
        setattr(req, _ADMITTED_ATTR, False)
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        if self.disable:
            return
        if getattr(req, _ADMITTED_ATTR):
            self.marconi.inserted(self.resolve_node_handle(req.last_node))
        if finished:
            fed = req.full_untruncated_fill_ids[:up_to]
            fed_ids = np.asarray(fed, dtype=np.int64)
            plan = getattr(req, PLAN_ATTR, None)
            memo = None if plan is None else plan.memo
            self.marconi.finished(fed_ids, len(req.origin_input_ids), memo)
            if self.marconi_tuner is not None:
                self.marconi_tuner.observe(req.origin_input_ids, fed)


def preset_from_env() -> str:
    """The ``marconi.cache`` preset the backend runs, from ``$SGLANG_MARCONI_PRESET`` (set by
    ``--marconi-preset``; default ``marconi``)."""
    preset = os.environ.get(PRESET_ENV) or SGLANG_PRESETS[0]
    if preset not in SGLANG_PRESETS:
        raise ValueError(f"${PRESET_ENV}={preset!r}: choose one of {', '.join(SGLANG_PRESETS)}")
    return preset


def alpha_from_env() -> float | None:
    """The FLOP-aware weight from ``$SGLANG_MARCONI_ALPHA`` (set by ``--marconi-alpha``):
    None for ``auto`` or unset (tuned online), else the fixed float."""
    return parse_alpha(os.environ.get(ALPHA_ENV))


def pool_state_bytes(ctx: TreeCacheBuildContext) -> tuple[int, int] | None:
    """(conv, SSM) bytes of one Mamba state slot as SGLang allocated them (all Mamba layers of
    one slot, times the TP size for the whole model), or None without a Mamba pool."""
    pool = getattr(ctx.params.req_to_token_pool, "mamba_pool", None)
    if pool is None:
        return None
    cache = pool.mamba_cache
    tp = max(1, int(ctx.tp_size))

    def per_slot(t: torch.Tensor) -> int:  # [layers, slots, ...]
        return t.nbytes // t.shape[1] * tp

    return sum(per_slot(t) for t in cache.conv), per_slot(cache.temporal)


def served_dtypes(ctx: TreeCacheBuildContext) -> CacheDtypes | None:
    """The dtypes SGLang's pools store (KV allocator, Mamba pool's conv and temporal state);
    None without a Mamba pool (then the HF config's dtypes are used)."""
    pool = getattr(ctx.params.req_to_token_pool, "mamba_pool", None)
    if pool is None:
        return None
    cache = pool.mamba_cache
    kv = getattr(ctx.params.token_to_kv_pool_allocator, "dtype", None) or cache.conv[0].dtype
    return CacheDtypes(
        str(kv).removeprefix("torch."), str(cache.temporal.dtype).removeprefix("torch.")
    )


def cost_model_for(ctx: TreeCacheBuildContext) -> CostModel:
    """Cost model of the served model: FLOPs and the layer specs from its HF config (raises
    ValueError if unsupported), bytes in the dtypes SGLang's pools store. The specs' state bytes
    must equal the Mamba pool's (SGLang keeps d_conv - 1 conv columns, as the specs count);
    a mismatch is logged, and the specs' figure kept."""
    hf_config = ctx.model_config.hf_config
    config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    name = str(getattr(ctx.model_config, "model_path", config.get("model_type", "served")))
    dtypes = served_dtypes(ctx)
    cost = cost_model_from_hf_config(
        config,
        name=name,
        dtype=None if dtypes is None else dtypes.kv,
        ssm_state_dtype=None if dtypes is None else dtypes.ssm,
    )
    pooled = pool_state_bytes(ctx)
    if pooled is not None and pooled != (cost.conv_state_bytes, cost.ssm_state_bytes):
        logger.warning(
            "marconi: SGLang's Mamba pool holds %s B (conv, ssm) per slot, the layer specs "
            "count %s B; the eviction scores use the specs'",
            pooled,
            (cost.conv_state_bytes, cost.ssm_state_bytes),
        )
    return cost


def marconi_cache_factory(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    """The factory registered as ``marconi``: SGLang's own construction path
    (``create_unified_radix_cache``) with ``MarconiRadixCache`` as the class."""
    alpha = alpha_from_env()
    start = AUTO_ALPHA_START if alpha is None else alpha
    policy = MarconiPolicy(cost_model_for(ctx), alpha=start, preset=preset_from_env())
    cache_class = functools.partial(MarconiRadixCache, marconi=policy, tune_alpha=alpha is None)
    return create_unified_radix_cache(ctx, cache_class=cache_class)  # type: ignore[arg-type]

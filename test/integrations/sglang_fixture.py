"""Real SGLang 0.5.23 cache objects on CPU for the plugin tests (imported only when sglang is).

Builds what SGLang's model runner builds for a hybrid model: a ``HybridReqToTokenPool`` (with its
``MambaPool``), a ``HybridLinearKVPool`` + ``TokenToKVPoolAllocator``, ``CacheInitParams``, and a
``TreeCacheBuildContext``; the cache itself comes from SGLang's registry. ``Session`` drives
requests through the scheduler's calls: ``Req.init_next_round_input`` (match), prefill into the
request's own slots, ``checkpoint`` on finish (insert), ``free_kv_row`` and ``unlock``.

Page size > 1 needs SGLang's ``extra_buffer`` Mamba mode (its ``MambaComponent`` asserts page
size 1 without it): the KV allocator is SGLang's ``PagedTokenToKVPoolAllocator``, each request
holds its working state plus two ping-pong tracking slots, and ``Session`` moves the tracked
state the way the scheduler does (after a prefill: the last whole checkpoint-grid position, or
the branch point; in decode: every ``TRACK_INTERVAL`` tokens).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    default_radix_cache_factory,
    get_radix_cache_factory,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

NUM_LAYERS = 8
FULL_LAYERS = (3, 7)  # attention layers; the other six are Mamba-2
CHUNK = 4  # mamba_cache_chunk_size: branch points are rounded down to multiples of it
TRACK_INTERVAL = 8  # --mamba-track-interval (extra_buffer): decode tracks a state this often

#: A tiny Nemotron-H-shaped HF config (what ``ModelConfig.hf_config.to_dict()`` gives).
HF_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "hybrid_override_pattern": "MMM*MMM*",
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "mamba_num_heads": 2,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 1,
    "conv_kernel": 4,
    "expand": 0.5,
    "vocab_size": 256,
    "torch_dtype": "bfloat16",
}


@dataclass
class Fixture:
    cache: Any
    allocator: Any
    pool: Any
    kv_size: int
    mamba_size: int
    page_size: int = 1

    @property
    def extra_buffer(self) -> bool:
        return bool(self.pool.enable_mamba_extra_buffer)

    def held_kv(self, req: Req) -> int:
        """KV slots ``req`` holds outside the tree (its whole pages past the protected prefix)."""
        p = self.page_size
        return -(-req.kv.kv_allocated_len // p) * p - req.kv.cache_protected_len

    def held_states(self, req: Req) -> int:
        """Mamba slots ``req`` holds: its working state, plus its tracking slots."""
        track = req.kv.mamba_ping_pong_empty or []
        return int(req.kv.mamba_pool_idx is not None) + sum(not e for e in track)


def state_pool(
    cache_params: Mamba2CacheParams,
    mamba_size: int,
    size: int = 8,
    max_context_len: int = 512,
    extra_buffer: bool = False,
) -> HybridReqToTokenPool:
    """A real SGLang request pool on CPU with ``mamba_size`` Mamba state slots (``no_buffer``,
    or ``extra_buffer``: two tracking slots per request)."""
    return HybridReqToTokenPool(
        size=size,
        mamba_size=mamba_size,
        mamba_spec_state_size=size,
        max_context_len=max_context_len,
        device="cpu",
        enable_memory_saver=False,
        cache_params=cache_params,
        mamba_layer_ids=cache_params.layers,
        enable_mamba_extra_buffer=extra_buffer,
        speculative_num_draft_tokens=3,
    )


def build(
    backend: str | None = "marconi",
    kv_size: int = 256,
    mamba_size: int = 12,
    page_size: int = 1,
    hf_config: dict[str, Any] | None = None,
    chunk: int = CHUNK,
    max_context_len: int = 512,
) -> Fixture:
    """A hybrid-model cache built by SGLang's registry factory ``backend`` (None: SGLang's
    default selection chain, i.e. ``--prefix-cache lru``); ``extra_buffer`` Mamba mode for
    page sizes > 1; ``chunk``: the Mamba state grid branch points are rounded down to. The
    ``marconi`` preset comes from ``$SGLANG_MARCONI_PRESET`` (as in a server);
    ``max_context_len``: the longest request the request pool takes."""
    extra_buffer = page_size > 1
    server_args = ServerArgs(model_path="dummy", page_size=page_size, radix_cache_backend=backend)
    server_args._mamba_cache_chunk_size = chunk
    server_args.mamba_track_interval = TRACK_INTERVAL
    set_global_server_args_for_scheduler(server_args)
    mamba_layers = [i for i in range(NUM_LAYERS) if i not in FULL_LAYERS]
    shape = Mamba2StateShape.create(
        tp_world_size=1,
        intermediate_size=32,
        n_groups=1,
        num_heads=2,
        head_dim=16,
        state_size=16,
        conv_kernel=4,
    )
    params = Mamba2CacheParams(shape=shape, layers=mamba_layers)
    pool = state_pool(
        params, mamba_size, max_context_len=max_context_len, extra_buffer=extra_buffer
    )
    kv_pool = HybridLinearKVPool(
        size=kv_size,
        dtype=torch.bfloat16,
        page_size=page_size,
        head_num=2,
        head_dim=32,
        full_attention_layer_ids=list(FULL_LAYERS),
        device="cpu",
        enable_memory_saver=False,
        mamba_pool=pool.mamba_pool,
    )
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(
            size=kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
        )
    else:
        allocator = PagedTokenToKVPoolAllocator(
            size=kv_size, page_size=page_size, dtype=torch.bfloat16, device="cpu",
            kvcache=kv_pool, need_sort=False,
        )  # fmt: skip
    cache_params = CacheInitParams(
        disable=False,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_mamba_extra_buffer=extra_buffer,
        # SGLang's default core is Rust; the tests inspect Python nodes (Marconi forces Python).
        tree_core_backend="python",
    )
    model_config = SimpleNamespace(
        hf_config=SimpleNamespace(to_dict=lambda: dict(hf_config or HF_CONFIG)),
        model_path="tiny-nemotron-h",
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=cache_params,
        is_hybrid_swa=False,
        is_hybrid_ssm=True,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=model_config,  # type: ignore[arg-type]
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )
    factory = default_radix_cache_factory if backend is None else get_radix_cache_factory(backend)
    assert factory is not None, f"backend {backend!r} is not registered"
    return Fixture(factory(ctx), allocator, pool, kv_size, mamba_size, page_size)


class Session:
    """Runs requests through the cache the way SGLang's scheduler does (no model forward:
    the state and KV slots are allocated and handed over, their contents are not computed)."""

    def __init__(self, fx: Fixture) -> None:
        self.fx = fx
        self._rid = 0

    def start(self, input_ids: list[int]) -> Req:
        """Match (``init_next_round_input``), allocate the request's slots, prefill."""
        fx = self.fx
        req = Req(
            rid=f"r{self._rid}",
            origin_input_text="",
            origin_input_ids=array("q", input_ids),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=16),
        )
        self._rid += 1
        req.init_next_round_input(fx.cache)
        if hasattr(fx.cache, "plan_request"):  # what the PrefillAdder hooks do (branch_split)
            fx.cache.plan_request(req)
        req.lock = fx.cache.lock(req.last_node)  # admitted: the match is pinned first
        need = 1 + fx.pool.mamba_initial_tracking_slots  # as the scheduler: free states first
        short = need - fx.pool.mamba_allocator.available_size()
        if short > 0:
            fx.cache.evict(EvictParams(mamba_num=short))
        fx.pool.alloc([req])
        prefix = fx.cache.path_device_indices(req.last_node)[: req.prefix_len]
        fx.pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
        self._append(req, req.prefix_len, len(input_ids))
        req.kv.cache_protected_len = req.prefix_len
        req.extend_end = len(input_ids)
        if fx.extra_buffer:
            self._track_prefill(req)
        return req

    def decode(self, req: Req, output_ids: list[int]) -> None:
        """Append decoded tokens (one KV slot each), tracking states as the scheduler does."""
        for token in output_ids:
            req.output_ids = array("q", [*req.output_ids, token])
            self._append(req, req.kv.kv_committed_len, req.kv.kv_committed_len + 1)
            if self.fx.extra_buffer and req.kv.kv_committed_len % TRACK_INTERVAL == 0:
                self._track(req, req.kv.kv_committed_len)

    def _append(self, req: Req, start: int, end: int) -> None:
        """KV slots for positions ``[start, end)`` (evicting first if short), in the row."""
        fx, p = self.fx, self.fx.page_size
        short = (-(-end // p) - -(-start // p)) * p - fx.allocator.available_size()
        if short > 0:
            fx.cache.evict(EvictParams(num_tokens=short))
        if p == 1:
            new = fx.allocator.alloc(end - start)
        else:
            row = fx.pool.req_to_token[req.kv.req_pool_idx]
            last = row[start - 1 : start].long() if start else torch.tensor([-1])
            at = [torch.tensor([x]) for x in (start, start, end, end)]
            new = fx.allocator.alloc_extend(*at, last, end - start)
        assert new is not None, "out of KV slots"
        fx.pool.write((req.kv.req_pool_idx, slice(start, end)), new)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = end

    def _track_prefill(self, req: Req) -> None:
        """The state a prefill tracks (``ScheduleBatch``'s extra_buffer branch): the last whole
        checkpoint-grid position of the extend, or the branch point inside it."""
        grid = CHUNK if self.fx.page_size == 1 else math.lcm(CHUNK, self.fx.page_size)
        extend = req.extend_end - req.prefix_len
        if extend < grid:
            return
        at = req.prefix_len + extend // grid * grid
        branch = req.mamba_branching_seqlen
        if branch is not None and req.prefix_len < branch < at:
            at = branch if (branch - req.prefix_len) % CHUNK == 0 else at
        self._track(req, at, prefill=True)

    def _track(self, req: Req, seqlen: int, prefill: bool = False) -> None:
        """The next ping-pong slot now holds the state at ``seqlen``."""
        kv, pool = req.kv, self.fx.pool
        if not prefill:  # decode keeps the previous checkpoint's length (a short key's fallback)
            kv.mamba_prev_track_seqlen = kv.mamba_last_track_seqlen
        kv.mamba_last_track_idx = kv.mamba_next_track_idx
        kv.mamba_next_track_idx = pool.get_mamba_ping_pong_other_idx(kv.mamba_next_track_idx)
        kv.mamba_last_track_seqlen = seqlen

    def checkpoint(self, req: Req, up_to: int) -> None:
        """What ``checkpoint_kv_cache`` does when a prefill chunk ends at ``up_to``."""
        self.fx.cache.checkpoint(req, up_to=up_to)

    def finish(self, req: Req) -> None:
        """What ``release_kv_cache`` does: checkpoint into the tree, free the rest, unlock."""
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        req.refresh_fill_ids()
        up_to = req.kv.kv_committed_len
        self.fx.cache.checkpoint(req, up_to=up_to)
        self.fx.cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, up_to)])
        self.fx.cache.unlock(req.lock)
        req.lock = None
        self.fx.pool.free(req)

    def run(self, input_ids: list[int], output_ids: list[int]) -> Req:
        req = self.start(input_ids)
        self.decode(req, output_ids)
        self.finish(req)
        return req

    def prefill(self, req: Req) -> None:
        """The scheduler's prefill checkpoints: a chunk ends at every planned prefill position
        inside the uncached tokens (``branch_split``'s cuts), and at the prompt end
        (``checkpoint_kv_cache`` after the last chunk of a request that goes on decoding)."""
        n = len(req.origin_input_ids)
        plan = getattr(req, "marconi_plan", None)
        stops = [p for p in (plan.prefill if plan else ()) if req.prefix_len < p < n]
        for up_to in [*stops, n]:
            self.checkpoint(req, up_to=up_to)

    def serve(self, input_ids: list[int], output_ids: list[int]) -> Req:
        """One request as a server runs it: match and plan, prefill in planned chunks,
        decode ``output_ids`` (the last one is sampled, never fed), finish."""
        req = self.start(input_ids)
        self.prefill(req)
        self.decode(req, output_ids[:-1])
        req.output_ids.append(output_ids[-1])  # sampled by the last step, never fed
        self.finish(req)
        return req

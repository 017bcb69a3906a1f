"""Real SGLang 0.5.23 cache objects on CPU for the plugin tests (imported only when sglang is).

Builds what SGLang's model runner builds for a hybrid model: a ``HybridReqToTokenPool`` (with its
``MambaPool``), a ``HybridLinearKVPool`` + ``TokenToKVPoolAllocator``, ``CacheInitParams``, and a
``TreeCacheBuildContext``; the cache itself comes from SGLang's registry. ``Session`` drives
requests through the scheduler's calls: ``Req.init_next_round_input`` (match), prefill into the
request's own slots, ``checkpoint`` on finish (insert), ``free_kv_row`` and ``unlock``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
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


def state_pool(
    cache_params: Mamba2CacheParams, mamba_size: int, size: int = 8, max_context_len: int = 512
) -> HybridReqToTokenPool:
    """A real SGLang request pool on CPU with ``mamba_size`` Mamba state slots (no_buffer)."""
    return HybridReqToTokenPool(
        size=size,
        mamba_size=mamba_size,
        mamba_spec_state_size=size,
        max_context_len=max_context_len,
        device="cpu",
        enable_memory_saver=False,
        cache_params=cache_params,
        mamba_layer_ids=cache_params.layers,
        enable_mamba_extra_buffer=False,
        speculative_num_draft_tokens=3,
    )


def build(
    backend: str | None = "marconi",
    kv_size: int = 256,
    mamba_size: int = 12,
    page_size: int = 1,
    hf_config: dict[str, Any] | None = None,
) -> Fixture:
    """A hybrid-model cache built by SGLang's registry factory ``backend`` (None: SGLang's
    default selection chain, i.e. ``--prefix-cache lru``)."""
    server_args = ServerArgs(model_path="dummy", page_size=page_size, radix_cache_backend=backend)
    server_args._mamba_cache_chunk_size = CHUNK
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
    pool = state_pool(Mamba2CacheParams(shape=shape, layers=mamba_layers), mamba_size)
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
    allocator = TokenToKVPoolAllocator(
        size=kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
    )
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        # SGLang's default core is Rust; the tests inspect Python nodes (Marconi forces Python).
        tree_core_backend="python",
    )
    model_config = SimpleNamespace(
        hf_config=SimpleNamespace(to_dict=lambda: dict(hf_config or HF_CONFIG)),
        model_path="tiny-nemotron-h",
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
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
    return Fixture(factory(ctx), allocator, pool, kv_size, mamba_size)


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
        if fx.pool.mamba_allocator.available_size() < 1:  # as the scheduler: free a state first
            fx.cache.evict(EvictParams(mamba_num=1))
        fx.pool.alloc([req])
        req.lock = fx.cache.lock(req.last_node)
        prefix = fx.cache.path_device_indices(req.last_node)[: req.prefix_len]
        need = len(input_ids) - req.prefix_len
        short = need - fx.allocator.available_size()
        if short > 0:
            fx.cache.evict(EvictParams(num_tokens=short))
        new = fx.allocator.alloc(need)
        assert new is not None, "out of KV slots"
        fx.pool.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix)
        fx.pool.write((req.kv.req_pool_idx, slice(req.prefix_len, len(input_ids))), new)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(input_ids)
        req.kv.cache_protected_len = req.prefix_len
        req.extend_end = len(input_ids)
        return req

    def decode(self, req: Req, output_ids: list[int]) -> None:
        """Append decoded tokens (one KV slot each)."""
        fx = self.fx
        start = req.kv.kv_committed_len
        new = fx.allocator.alloc(len(output_ids))
        assert new is not None, "out of KV slots"
        req.output_ids = array("q", [*req.output_ids, *output_ids])
        fx.pool.write((req.kv.req_pool_idx, slice(start, start + len(output_ids))), new)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = start + len(output_ids)

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

"""Real SGLang 0.5.23 objects on CPU for the Jamba tests (imported only when sglang is).

- ``publish_parallel``: SGLang's single-process parallel setup, as its own layer tests do
  (``sglang.test.layer_ut_utils.init_single_process_dist``, which cannot be imported here: its
  module pulls SGLang's benchmark datasets): a world-1 ``gloo`` group, a published
  ``ServerArgs`` topology (TP=PP=EP=1), SGLang's model-parallel groups.
- ``bind_portable_conv_kernels``: SGLang's ``layers/attention/mamba/mamba.py`` binds the causal
  conv kernels that its Mamba-1 mixer imports only on CUDA, NPU or XPU; on any other device the
  import of ``mamba1.py`` raises ``ImportError``. This binds the XPU choice (SGLang's own
  portable Triton kernels, ``sglang.kernels.ops.mamba.causal_conv1d_triton``) under the same
  names so the mixer can be *constructed* on CPU. No kernel runs in these tests.
- ``write_checkpoint``: a tiny HF Jamba checkpoint, from transformers' ``JambaForCausalLM``
  (random init, ``save_pretrained``: the per-expert tensor names of the Hub checkpoints) or from
  marconi's embedded ``tiny-jamba`` writer.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
from marconi.models.tiny import TINY_JAMBA_CONFIG


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def publish_parallel() -> None:
    """World-1 gloo process group + SGLang's published topology + model-parallel groups
    (idempotent within a process)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _free_port(), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # fmt: skip
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not model_parallel_is_initialized():
        reset_context()
        publish(
            ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1),
            role="test",
            ranks=SpawnRanks(world_rank=0),
        )
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")


def bind_portable_conv_kernels() -> None:
    """Bind SGLang's Triton causal-conv kernels where its Mamba module left the names unbound
    (any device but CUDA/NPU/XPU); see the module docstring."""
    import sglang.srt.layers.attention.mamba.mamba as mamba
    from sglang.kernels.ops.mamba import causal_conv1d_triton

    for name in ("causal_conv1d_fn", "causal_conv1d_update"):
        if not hasattr(mamba, name):
            kernel = getattr(causal_conv1d_triton, name)
            setattr(mamba, name, kernel)
            setattr(mamba, f"{name}_triton", kernel)


def hf_config_dict(source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Jamba ``config.json`` dict (default: marconi's ``tiny-jamba``), comments dropped."""
    return {k: v for k, v in (source or TINY_JAMBA_CONFIG).items() if not k.startswith("_")}


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_checkpoint(folder: Path, writer: str) -> Path:
    """A tiny Jamba checkpoint folder (config.json + safetensors) from ``writer``:
    ``"transformers"`` or ``"marconi"`` (``marconi.models.tiny.ensure_tiny("tiny-jamba")``)."""
    if writer == "transformers":
        from transformers import JambaConfig, JambaForCausalLM

        cfg = {k: v for k, v in hf_config_dict().items() if k != "architectures"}
        torch.manual_seed(0)
        JambaForCausalLM(JambaConfig(**cfg)).save_pretrained(str(folder))
        return folder
    if writer == "marconi":
        from marconi.models import tiny

        old = os.environ.get("MARCONI_CACHE_DIR")
        os.environ["MARCONI_CACHE_DIR"] = str(folder)
        try:
            return tiny.ensure_tiny("tiny-jamba")
        finally:
            if old is None:
                del os.environ["MARCONI_CACHE_DIR"]
            else:
                os.environ["MARCONI_CACHE_DIR"] = old
    raise ValueError(f"unknown checkpoint writer {writer!r}")


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, through SGLang's own iterator."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in folder.glob("*.safetensors"))
    return {name: t.clone() for name, t in safetensors_weights_iterator(files)}


def expected_region(
    name: str, tensor: torch.Tensor, param: torch.Tensor, target: Any, config: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the part of ``param`` that checkpoint tensor ``name`` must have filled, the tensor), at
    TP=1: stacked projections fill row blocks (q|k|v, gate|up), experts fill ``w13[e]`` (gate
    rows then up rows) or ``w2[e]``, vocabulary-padded embeddings fill their first rows."""
    if target.expert is not None:
        inter = config.intermediate_size
        rows = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter), "w2": slice(None)}
        return param[target.expert][rows[target.shard]], tensor
    if target.shard in ("q", "k", "v"):
        heads, kv, head_dim = (config.num_attention_heads, config.num_key_value_heads,
                               config.hidden_size // config.num_attention_heads)  # fmt: skip
        q, k = heads * head_dim, kv * head_dim
        start = {"q": 0, "k": q, "v": q + k}[target.shard]
        return param[start : start + tensor.shape[0]], tensor
    if target.shard in (0, 1):
        inter = config.intermediate_size
        return param[target.shard * inter : (target.shard + 1) * inter], tensor
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return param[: tensor.shape[0]], tensor
    return param, tensor


def build_cache(model_config: Any, backend: str | None = "marconi", kv_size: int = 256,
                mamba_size: int = 6) -> Any:  # fmt: skip
    """``sglang_fixture.build`` for a served Jamba: the ``MambaPool`` from the config's
    ``mamba2_cache_params`` (Mamba-1 shapes), the KV pool over its ``full_attention_layer_ids``,
    and SGLang's real ``ModelConfig`` in the ``TreeCacheBuildContext`` (the backend's cost
    model reads ``model_config.hf_config``)."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool
    from sglang.srt.mem_cache.registry import (
        TreeCacheBuildContext,
        default_radix_cache_factory,
        get_radix_cache_factory,
    )
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang_fixture import CHUNK, Fixture, state_pool

    server_args = ServerArgs(model_path="dummy", page_size=1, radix_cache_backend=backend)
    server_args._mamba_cache_chunk_size = CHUNK
    set_global_server_args_for_scheduler(server_args)
    hybrid = mambaish_config(model_config)
    cache_params = hybrid.mamba2_cache_params
    pool = state_pool(cache_params, mamba_size)
    cfg = model_config.hf_config
    kv_pool = HybridLinearKVPool(
        size=kv_size, dtype=torch.bfloat16, page_size=1, head_num=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        full_attention_layer_ids=hybrid.full_attention_layer_ids, device="cpu",
        enable_memory_saver=False, mamba_pool=pool.mamba_pool,
    )  # fmt: skip
    allocator = TokenToKVPoolAllocator(
        size=kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kv_pool, need_sort=False
    )
    params = CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator,
        page_size=1, tree_core_backend="python",
    )  # fmt: skip
    ctx = TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
        enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None,
        model_config=model_config, tp_size=1, tp_rank=0, tp_group=None,
    )  # fmt: skip
    factory = default_radix_cache_factory if backend is None else get_radix_cache_factory(backend)
    assert factory is not None, f"backend {backend!r} is not registered"
    return Fixture(factory(ctx), allocator, pool, kv_size, mamba_size)

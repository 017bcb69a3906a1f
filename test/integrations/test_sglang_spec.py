"""SGLang's own pools hold exactly the bytes of marconi's layer specs (``marconi.cache.spec``) for
every embedded model: KV per token (``HybridLinearKVPool``) and one Mamba state slot
(``MambaPool``), in the dtypes SGLang allocates them in; and the backend's cost model counts
the same bytes as the pools it runs beside. Runs in the SGLang virtualenv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (run `make test-sglang`)")

import torch
from marconi.cache.spec import CacheDtypes, cache_spec_from_hf
from marconi.models.tiny import TINY_MODELS
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool
from sglang.srt.plugins import load_plugins
from sglang_fixture import state_pool
from sglang_jamba_fixture import hf_config_dict, publish_parallel, write_config

#: SGLang's own spelling of the Nemotron-H fields it reads (``NemotronHConfig.__init__``)
SGLANG_NEMOTRON_KEYS = ("mamba_n_groups", "mamba_d_conv")


def _sglang_config(name: str, tmp_path: Path) -> Any:
    hf = TINY_MODELS[name][0]
    if hf["architectures"][0] == "NemotronHForCausalLM":
        missing = [k for k in SGLANG_NEMOTRON_KEYS if k not in hf]
        if missing:
            pytest.skip(f"{name}'s config lacks SGLang's keys {missing} (added by issue 9)")
    # the config as SGLang loads a model folder: its config classes, its hybrid-cache view
    return mambaish_config(ModelConfig(str(write_config(tmp_path, hf_config_dict(hf)))))


def _pool_bytes(config: Any, kv_heads: int, head_dim: int) -> tuple[int, int, CacheDtypes]:
    """(KV bytes per token, state bytes per slot, dtypes) of real SGLang pools for ``config``."""
    params = config.mamba2_cache_params
    pool = state_pool(params, mamba_size=2, size=2, max_context_len=64)
    cache = pool.mamba_pool.mamba_cache
    slots = cache.temporal.shape[1]
    state = (sum(t.nbytes for t in cache.conv) + cache.temporal.nbytes) // slots
    kv_pool = HybridLinearKVPool(
        size=8, dtype=torch.bfloat16, page_size=1, head_num=kv_heads, head_dim=head_dim,
        full_attention_layer_ids=list(config.full_attention_layer_ids), device="cpu",
        enable_memory_saver=False, mamba_pool=pool.mamba_pool,
    )  # fmt: skip
    full = kv_pool.full_kv_pool
    kv = sum(b[0].nbytes for b in (*full.k_buffer, *full.v_buffer))
    conv_dtype = {t.dtype for t in cache.conv}.pop()
    assert conv_dtype == full.k_buffer[0].dtype  # one dtype for KV and conv state, as we count
    name = str(conv_dtype).removeprefix("torch.")
    return kv, state, CacheDtypes(name, str(cache.temporal.dtype).removeprefix("torch."))


@pytest.fixture(autouse=True)
def _registered() -> None:
    load_plugins()
    publish_parallel()


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_sglang_pools_hold_the_layer_specs_bytes(name: str, tmp_path: Path) -> None:
    hf = TINY_MODELS[name][0]
    config = _sglang_config(name, tmp_path)
    spec = cache_spec_from_hf(hf)
    attn, _ = spec.uniform()
    assert attn is not None
    kv, state, dtypes = _pool_bytes(config, attn.num_kv_heads, attn.head_dim)
    assert (kv, state) == (spec.kv_bytes_per_token(dtypes), spec.state_bytes(dtypes))


def test_backend_cost_model_counts_its_pools_bytes() -> None:
    """``cost_model_for`` (the layer specs in the pools' dtypes) == the Mamba pool's bytes."""
    from sglang_fixture import build

    fx = build()
    cost = fx.cache.marconi.cost
    cache = fx.pool.mamba_pool.mamba_cache
    slots = cache.temporal.shape[1]
    conv = sum(t.nbytes for t in cache.conv) // slots
    assert (cost.conv_state_bytes, cost.ssm_state_bytes) == (conv, cache.temporal.nbytes // slots)

"""``JambaForCausalLM`` for SGLang (``marconi.integrations.sglang``) against ``sglang==0.5.23``.

Runs in the SGLang virtualenv; skipped where ``sglang`` is not installed. What runs on CPU:

- the plugin entry point (through SGLang's ``load_plugins``) registers the config and the model:
  SGLang's ``ModelRegistry`` resolves ``JambaForCausalLM`` to ours, its linear-attention registry
  holds the Jamba spec, ``AutoConfig`` builds our ``JambaConfig``;
- SGLang's ``ModelConfig`` + ``mambaish_config`` for tiny-jamba and the Jamba-1.5-Mini config:
  attention / Mamba layer ids from ``attn_layer_period/offset``, a real ``MambaPool`` with Mamba-1
  state shapes, and its bytes against marconi's cost model;
- the model built on CPU from SGLang's layers (``einops``, which SGLang's MoE and Mamba
  modules import, and SGLang's portable conv kernels bound as on XPU: see the fixture) and
  ``load_weights`` of every tensor of an HF checkpoint (transformers' and marconi's writers),
  checked value by value; the learned dt/B/C norms against transformers' ``JambaMambaMixer``.

No forward pass runs: SGLang's Mamba-1 conv, scan and MoE kernels are CUDA/Triton only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (run `make test-sglang`)")

sys.path.insert(0, str(Path(__file__).parent))

import torch
from marconi.cache.cost import PRESET_DIR, cost_model_from_hf_config
from marconi.integrations.sglang import plugin
from marconi.integrations.sglang.jamba_config import ARCH, MAMBA2_BACKEND, JambaConfig
from marconi.integrations.sglang.policy import node_depth
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_spec
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import get_parallel
from sglang.test.parallel_groups import parallel_scope
from sglang_fixture import Fixture, Session, state_pool
from sglang_jamba_fixture import (
    bind_portable_conv_kernels,
    build_cache,
    expected_region,
    hf_config_dict,
    publish_parallel,
    read_checkpoint,
    write_checkpoint,
    write_config,
)

MINI = hf_config_dict(json.loads((PRESET_DIR / "jamba-1.5-mini.json").read_text()))
CONFIGS = {"tiny-jamba": hf_config_dict(), "jamba-1.5-mini": MINI}


@pytest.fixture(autouse=True)
def _registered() -> None:
    load_plugins()  # SGLang's own loader runs our entry point
    publish_parallel()


def sglang_model_config(folder: Path) -> ModelConfig:
    return ModelConfig(str(folder))


# ---------------------------------------------------------------- registration
def test_model_registry_resolves_jamba_to_ours_in_a_fresh_process() -> None:
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.models.registry import ModelRegistry\n"
        "cls, arch = ModelRegistry.resolve_model_cls(['JambaForCausalLM'])\n"
        "print(cls.__module__ + '.' + cls.__qualname__, arch, ModelRegistry._default_models_loaded)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # Ours, found through $SGLANG_EXTERNAL_MODEL_PACKAGE without importing SGLang's 300 models.
    assert out.stdout.split()[-3:] == [
        "marconi.integrations.sglang.models.jamba.JambaForCausalLM",
        ARCH,
        "False",
    ]


def test_plugin_registers_config_and_linear_attention_spec(tmp_path: Path) -> None:
    assert os.environ[plugin.EXTERNAL_MODELS_ENV] == plugin.MODELS_PACKAGE
    plugin.register()  # idempotent: no second spec, no error
    mc = sglang_model_config(write_config(tmp_path, CONFIGS["tiny-jamba"]))
    assert type(mc.hf_config) is JambaConfig
    spec = get_linear_attn_spec(mc.hf_config)
    assert spec is not None and spec.arch_names == [ARCH]
    assert spec.backend_class_name == MAMBA2_BACKEND
    assert spec.uses_mamba_radix_cache and not spec.support_mamba_cache_extra_buffer


# ---------------------------------------------------------------- hybrid cache shapes
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_ids_follow_attn_layer_period_and_offset(tmp_path: Path, name: str) -> None:
    cfg = CONFIGS[name]
    mc = sglang_model_config(write_config(tmp_path, cfg))
    hybrid = mambaish_config(mc)
    assert hybrid is mc.hf_config
    n, period, offset = cfg["num_hidden_layers"], cfg["attn_layer_period"], cfg["attn_layer_offset"]
    attention = [i for i in range(n) if i % period == offset]
    assert hybrid.full_attention_layer_ids == attention
    assert hybrid.mamba2_cache_params.layers == [i for i in range(n) if i not in attention]
    cost = cost_model_from_hf_config(mc.hf_config.to_dict())
    assert (cost.layers.attention, cost.layers.ssm) == (len(attention), n - len(attention))
    if name == "jamba-1.5-mini":
        assert attention == [4, 12, 20, 28]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mamba_pool_holds_mamba1_states_sized_like_marconis_cost_model(
    tmp_path: Path, name: str
) -> None:
    cfg = CONFIGS[name]
    mc = sglang_model_config(write_config(tmp_path, cfg))
    params = mambaish_config(mc).mamba2_cache_params
    d_inner, d_state, d_conv = (cfg["mamba_expand"] * cfg["hidden_size"], cfg["mamba_d_state"],
                                cfg["mamba_d_conv"])  # fmt: skip
    assert params.shape.conv == [(d_inner, d_conv - 1)]
    assert params.shape.temporal == (d_inner, 1, d_state)
    assert (params.dtype.conv, params.dtype.temporal) == (torch.bfloat16, torch.float32)
    layers = len(params.layers)
    if name == "tiny-jamba":  # a real MambaPool (jamba-1.5-mini's: ~15 MiB a slot)
        pool = state_pool(params, mamba_size=3, size=2, max_context_len=64)
        cache = pool.mamba_pool.mamba_cache
        slots = cache.temporal.shape[1]
        assert tuple(cache.conv[0].shape) == (layers, slots, d_inner, d_conv - 1)
        assert tuple(cache.temporal.shape) == (layers, slots, d_inner, 1, d_state)
        per_slot = (cache.conv[0].nbytes + cache.temporal.nbytes) // slots
        assert per_slot == params.mamba_cache_per_req
    cost = cost_model_from_hf_config(mc.hf_config.to_dict())
    # SSM state: identical (fp32, [d_inner, d_state] per Mamba layer).
    assert cost.ssm_state_bytes == layers * d_inner * d_state * 4
    assert cost.ssm_state_bytes == params.mamba_cache_per_req - layers * d_inner * (d_conv - 1) * 2
    # Conv state: SGLang keeps d_conv - 1 columns (the newest input is not stored), as marconi's
    # layer specs count it (transformers' cache keeps the whole window: conv_columns=d_conv).
    assert cost.conv_state_bytes == layers * d_inner * (d_conv - 1) * 2
    assert params.mamba_cache_per_req == cost.state_bytes
    # KV: the attention layers' K and V per token, in the model dtype (bf16).
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = len(mambaish_config(mc).full_attention_layer_ids)
    assert cost.kv_bytes_per_token == attn * 2 * cfg["num_key_value_heads"] * head_dim * 2


def test_mamba_state_shards_over_tensor_parallel_ranks(tmp_path: Path) -> None:
    mc = sglang_model_config(write_config(tmp_path, MINI))
    # SGLang's own fixture for TP metadata without a 4-process group (sglang.test).
    with parallel_scope(tp_size=4, attn_tp_size=4, moe_tp_size=4, tp_rank=1, attn_tp_rank=1):
        assert get_parallel().tp_size == 4
        params = mc.hf_config.mamba2_cache_params
    assert params.shape.conv == [(8192 // 4, 3)]
    assert params.shape.temporal == (8192 // 4, 1, 16)


# ---------------------------------------------------------------- model + weights
@pytest.fixture(scope="module")
def model_cls() -> type:
    load_plugins()
    bind_portable_conv_kernels()
    from sglang.srt.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls([ARCH])
    return cls


def build(model_cls: type, folder: Path) -> torch.nn.Module:
    publish_parallel()
    config = sglang_model_config(folder).hf_config
    model = model_cls(config=config, quant_config=None)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # anything not loaded stays NaN
    return model


@pytest.mark.parametrize("writer", ["transformers", "marconi"])
def test_load_weights_fills_every_parameter_from_an_hf_checkpoint(
    model_cls: type, tmp_path: Path, writer: str
) -> None:
    from marconi.integrations.sglang.models.jamba import weight_target

    folder = write_checkpoint(tmp_path / writer, writer)
    model = build(model_cls, folder)
    config = model.config
    tensors = read_checkpoint(folder)
    params = dict(model.named_parameters())
    targets = {name: weight_target(name, config.num_experts) for name in tensors}
    assert sorted(n for n, t in targets.items() if t.param not in params) == []

    loaded = model.load_weights(iter(tensors.items()))

    assert loaded == set(params)  # every parameter received a checkpoint tensor
    for name, tensor in tensors.items():
        region, want = expected_region(name, tensor, params[targets[name].param],
                                       targets[name], config)  # fmt: skip
        assert torch.equal(region, want.to(region.dtype)), name
    vocab = config.vocab_size
    for name, p in params.items():
        rows = p[:vocab] if name.endswith(("embed_tokens.weight", "lm_head.weight")) else p
        assert not torch.isnan(rows).any(), f"{name} was not (fully) loaded"
    attn_layer = model.model.layers[config.attn_layer_offset]
    assert attn_layer.is_attention and not hasattr(attn_layer, "mamba")
    experts = sum(1 for n in params if n.endswith("experts.w13_weight"))
    assert experts == sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


def test_learned_dt_b_c_norms_match_transformers_jamba_mixer(
    model_cls: type, tmp_path: Path
) -> None:
    from transformers import JambaForCausalLM as HFJamba

    folder = write_checkpoint(tmp_path / "hf", "transformers")
    model = build(model_cls, folder)
    model.load_weights(iter(read_checkpoint(folder).items()))
    hf = HFJamba.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():  # random, not all-ones norm weights, so the norms matter
        for norm in ("dt_layernorm", "b_layernorm", "c_layernorm"):
            w = torch.rand_like(getattr(hf.model.layers[0].mamba, norm).weight) + 0.5
            getattr(hf.model.layers[0].mamba, norm).weight.copy_(w)
            getattr(model.model.layers[0].mamba, norm).weight.copy_(w)
    ours, theirs = model.model.layers[0].mamba, hf.model.layers[0].mamba
    x = torch.randn(5, ours.intermediate_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dt, b, c = ours._ssm_params(x)
        r, n = theirs.time_step_rank, theirs.ssm_state_size
        ts, b_ref, c_ref = torch.split(theirs.x_proj(x), [r, n, n], dim=-1)
        dt_ref = theirs.dt_proj(theirs.dt_layernorm(ts))
        b_ref, c_ref = theirs.b_layernorm(b_ref), theirs.c_layernorm(c_ref)
    for got, want in ((dt, dt_ref), (b, b_ref), (c, c_ref)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- Marconi on Jamba
def state_depths(fx: Fixture) -> list[int]:
    tc = fx.cache.tree_core
    return sorted(
        node_depth(n)
        for n in tc._collect_all_nodes()
        if n is not tc.root_node and n.component_data[ComponentType.MAMBA].value is not None
    )


def test_marconi_backend_caches_jamba_states_at_branch_points(tmp_path: Path) -> None:
    """The ``marconi`` backend over a Jamba-shaped pool (Mamba-1 states, KV on layer 4 only),
    built from SGLang's real ``ModelConfig``: cost model and admission work unchanged."""
    mc = sglang_model_config(write_config(tmp_path, CONFIGS["tiny-jamba"]))
    fx = build_cache(mc)
    cost = fx.cache.marconi.cost
    assert (cost.layers.attention, cost.layers.ssm, cost.layers.moe) == (1, 7, 4)
    s = Session(fx)
    system = list(range(100, 120))  # 20 tokens: branch point 20 (a multiple of CHUNK)
    s.run([*system, 1, 2, 3], [7])
    req = s.start([*system, 4, 5, 6])
    assert req.mamba_branching_seqlen == 20
    s.checkpoint(req, up_to=12)  # not a branch point: declined
    s.checkpoint(req, up_to=20)  # the branch point: admitted
    s.decode(req, [8])
    s.finish(req)
    assert state_depths(fx) == [20, 24, 24]
    st = fx.cache.marconi.stats
    assert (st.branch_states, st.decode_states, st.states_declined) == (1, 2, 1)
    nxt = s.start([*system, 42])
    assert nxt.prefix_len == 20 and fx.cache.marconi.stats.states_reused == 1
    s.finish(nxt)
    cache = fx.cache
    cache.sanity_check()
    kv = fx.allocator.available_size() + cache.full_evictable_size() + cache.full_protected_size()
    states = (fx.pool.mamba_allocator.available_size() + cache.mamba_evictable_size()
              + cache.mamba_protected_size())  # fmt: skip
    assert (kv, states) == (fx.kv_size, fx.mamba_size)

"""Cost model: bytes equal what transformers allocates; FLOPs follow the paper and add up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from marconi.cache.cost import (
    PRESET_DIR,
    CostModel,
    LayerCounts,
    cost_model_from_hf_config,
    list_presets,
    load_cost_model,
)
from marconi.cache.hf_config import parse_hf_config

PRESETS = [
    "paper-7b", "jamba-1.5-mini", "nemotron-h-8b", "granite-4.0-h-tiny", "bamba-9b",
    "falcon-h1-7b", "zamba2-2.7b", "mamba2-2.7b", "llama-3.1-8b",
]  # fmt: skip
TOKENS = 7


def _tiny_configs() -> dict[str, Any]:
    tf = pytest.importorskip("transformers")
    common = {"vocab_size": 64, "hidden_size": 32, "dtype": "bfloat16"}
    return {
        "jamba": tf.JambaConfig(
            **common,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=4,
        ),
        "nemotron_h": tf.NemotronHConfig(
            **common,
            hybrid_override_pattern="M*-ME",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            mamba_num_heads=8,
            mamba_head_dim=8,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=3,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
            chunk_size=8,
        ),
        "bamba": tf.BambaConfig(
            **common,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
        ),
        "granite": tf.GraniteMoeHybridConfig(
            **common,
            intermediate_size=16,
            shared_intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            layer_types=["mamba", "attention", "mamba"],
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
        ),
        "falcon_h1": tf.FalconH1Config(
            **common,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            mamba_d_ssm=48,
            mamba_n_heads=4,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_chunk_size=8,
        ),
        "zamba2": tf.Zamba2Config(
            **common,
            num_hidden_layers=3,
            layers_block_type=["mamba", "hybrid", "mamba"],
            num_attention_heads=4,
            num_mem_blocks=1,
            n_mamba_heads=4,
            mamba_d_state=8,
            mamba_ngroups=1,
            chunk_size=8,
            intermediate_size=64,
        ),
        "mamba2": tf.Mamba2Config(
            **common,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=8,
            state_size=16,
            n_groups=2,
            expand=2,
            conv_kernel=4,
            chunk_size=8,
        ),
        "llama": tf.LlamaConfig(
            **common,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    }


def _allocated_bytes(config: Any) -> tuple[int, int]:
    """(KV bytes of TOKENS tokens, conv+ssm state bytes) of the cache transformers fills."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 64, (1, TOKENS)), use_cache=True)
    kv = state = 0
    for layer in out.past_key_values.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            kv += tensor.nbytes if isinstance(tensor, torch.Tensor) else 0
        for name in ("conv_states", "recurrent_states"):
            state += sum(
                t.nbytes for t in (getattr(layer, name, None) or {}).values() if t is not None
            )
    return kv, state


@pytest.mark.parametrize(
    "arch", ["jamba", "nemotron_h", "bamba", "granite", "falcon_h1", "zamba2", "mamba2", "llama"]
)
def test_bytes_equal_what_transformers_allocates(arch: str) -> None:
    config = _tiny_configs()[arch]
    kv, state = _allocated_bytes(config)
    runtime = cost_model_from_hf_config(config.to_dict(), name=arch)  # d_conv - 1 conv columns
    d_conv = runtime.ssm[0].d_conv if runtime.ssm else None
    model = cost_model_from_hf_config(config.to_dict(), name=arch, conv_columns=d_conv)
    assert runtime.kv_bytes_per_token == model.kv_bytes_per_token
    if d_conv is not None:  # transformers keeps the whole conv window, runtimes one column less
        conv_col = model.conv_state_bytes // d_conv
        assert runtime.state_bytes == model.state_bytes - conv_col
    assert model.kv_bytes_per_token * TOKENS == kv
    assert model.state_bytes == state
    assert model.has_attention == (kv > 0) and model.has_ssm == (state > 0)


def test_tiny_jamba_layer_counts_and_ssm_dtype() -> None:
    model = cost_model_from_hf_config(_tiny_configs()["jamba"].to_dict())
    assert model.layers == LayerCounts(attention=2, ssm=2, mlp=2, moe=2)
    assert (model.dtype, model.ssm_state_dtype) == ("bfloat16", "float32")


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_is_additive(name: str) -> None:
    assert name in list_presets()
    for causal in (False, True):
        model = load_cost_model(name, causal_attention=causal)
        e = np.array([1, 17, 500, 4096, 10_000])
        s = np.array([0, 5, 499, 1000, 0])
        assert np.array_equal(
            model.prefill_flops(e), model.prefill_flops(s) + model.prefill_flops(e, s)
        )
        assert model.prefill_flops(4096, 1000) == model.prefill_flops(e, s)[3]
        assert model.prefill_flops(5, 5) == 0.0
        assert np.all(np.diff(model.prefill_flops(np.arange(100))) > 0)


def test_paper_formulas_for_attention_and_mlp() -> None:
    d, heads, n = 256, 8, 300
    config = {
        "architectures": ["NemotronHForCausalLM"], "hidden_size": d,
        "hybrid_override_pattern": "*-", "num_attention_heads": heads,
        "num_key_value_heads": heads, "head_dim": d // heads, "intermediate_size": 4 * d,
    }  # fmt: skip
    model = cost_model_from_hf_config(config)
    assert model.prefill_flops(n) == 8 * n * d**2 + 4 * n**2 * d + 16 * n * d**2
    causal = cost_model_from_hf_config(config, causal_attention=True)
    assert causal.prefill_flops(n) == 8 * n * d**2 + 2 * n * (n + 1) * d + 16 * n * d**2
    assert model.kv_bytes_per_token == 2 * d * 2  # the paper's 4LD bytes per layer, bf16


def test_mamba1_flops_are_paper_formula_plus_conv_and_dt_terms() -> None:
    d, n_state, rank, conv, n = 128, 16, 8, 4, 50
    config = {
        "architectures": ["MambaForCausalLM"], "hidden_size": d, "num_hidden_layers": 1,
        "state_size": n_state, "expand": 2, "conv_kernel": conv, "time_step_rank": rank,
    }  # fmt: skip
    model = cost_model_from_hf_config(config)
    paper = 12 * n * d**2 + 16 * n * d * n_state + 10 * n * d
    assert model.prefill_flops(n) == paper + n * (4 * conv * d + 8 * d * rank)
    assert model.kv_bytes_per_token == 0
    assert model.state_bytes == 2 * d * (conv - 1) * 2 + 2 * d * n_state * 4


def test_jamba_mini_numbers() -> None:
    model = load_cost_model("jamba-1.5-mini")
    assert model.layers == LayerCounts(attention=4, ssm=28, mlp=16, moe=16)
    assert model.kv_bytes_per_token == 4 * 2 * 8 * 128 * 2
    d_inner = 2 * 4096
    assert model.conv_state_bytes == 28 * d_inner * 3 * 2  # d_conv - 1 columns, as runtimes keep
    assert model.ssm_state_bytes == 28 * d_inner * 16 * 4
    assert model.state_bytes == model.conv_state_bytes + model.ssm_state_bytes


def test_paper_7b_matches_papers_17_4_gb_for_10k_tokens() -> None:
    model = load_cost_model("paper-7b")
    assert model.layers == LayerCounts(attention=4, ssm=24, mlp=28, moe=0)
    assert model.ssm_state_dtype == "float16"
    # vLLM+ in the paper: one checkpoint every 32 tokens of a 10K-token sequence -> 17.4 GB,
    # counting the whole conv window as transformers does; runtimes keep one column less.
    paper = load_cost_model("paper-7b", conv_columns=4)
    assert round(paper.cache_bytes(10_240, 10_240 // 32) / 1e9, 1) == 17.4
    assert round(model.cache_bytes(10_240, 10_240 // 32) / 1e9, 1) == 17.2


def test_pure_attention_has_no_state_and_pure_mamba_no_kv() -> None:
    llama, mamba2 = load_cost_model("llama-3.1-8b"), load_cost_model("mamba2-2.7b")
    assert llama.state_bytes == 0 and not llama.has_ssm and llama.has_attention
    assert llama.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert mamba2.kv_bytes_per_token == 0 and mamba2.has_ssm and not mamba2.has_attention
    assert mamba2.prefill_flops(200) == 200 * mamba2.flops_per_token  # linear in tokens


def test_dtype_argument_overrides_cache_dtypes() -> None:
    base = load_cost_model("nemotron-h-8b")
    half = load_cost_model("nemotron-h-8b", dtype="fp16")
    assert (half.dtype, half.ssm_state_dtype) == ("fp16", "fp16")
    assert half.ssm_state_bytes * 2 == base.ssm_state_bytes
    assert half.kv_bytes_per_token == base.kv_bytes_per_token
    mixed = load_cost_model("nemotron-h-8b", dtype="float32", ssm_state_dtype="bf16")
    assert mixed.kv_bytes_per_token == 2 * base.kv_bytes_per_token
    assert mixed.ssm_state_bytes == half.ssm_state_bytes


def test_flops_saved_per_byte() -> None:
    model = load_cost_model("jamba-1.5-mini")
    expected = model.prefill_flops(300, 100) / (200 * model.kv_bytes_per_token + model.state_bytes)
    assert model.flops_saved_per_byte(300, 100) == pytest.approx(expected)
    no_state = model.flops_saved_per_byte(np.array([300, 5]), np.array([100, 5]), with_state=False)
    assert no_state[0] == pytest.approx(model.prefill_flops(300, 100) / (200 * 16384))
    assert no_state[1] == 0.0


def test_load_from_path_and_unknown_name(tmp_path: Path) -> None:
    config = json.loads((PRESET_DIR / "bamba-9b.json").read_text())
    folder = tmp_path / "my-bamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    by_folder, by_file = load_cost_model(str(folder)), load_cost_model(str(folder / "config.json"))
    assert by_folder.name == by_file.name == "my-bamba"
    assert by_folder == CostModel.from_parsed("my-bamba", parse_hf_config(config))
    with pytest.raises(ValueError, match=r"jamba-1\.5-mini"):
        load_cost_model("no-such-model")

"""The embedded models: `tiny` (the default, Nemotron-H layout), `tiny-jamba` and `small` (a
~150M-parameter Nemotron-H layout for benchmarks closer to real per-token costs).

Created from a fixed seed on first use and saved as complete HF folders (`hf_folder.py`: config,
weights, byte-level tokenizer, chat template, generation config) under
`$MARCONI_CACHE_DIR/models/<name>` (default `~/.cache/marconi`), then loaded like any other
checkpoint. Byte-level vocabulary (256 bytes + bos 256, eos 257, pad 258). SSM decay rates are
initialised near zero (|A| in [0.01, 0.1], dt in [0.001, 0.1]) so states carry information across
thousands of tokens and a wrong resume state shows up in the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from marconi.models.hf_folder import WEIGHTS, write_hf_folder, write_metadata
from marconi.paths import cache_dir

VOCAB, BOS, EOS, PAD = 260, 256, 257, 258
_TINY_PATTERN = "M-M-M-*-M-M-M-M-M-M-*-M-M-M-"

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": VOCAB,
    "hidden_size": 384,
    # The pattern string is the one layer-type field that transformers, SGLang 0.5.23 and vLLM
    # all parse (their `layers_block_type` vocabularies differ).
    "hybrid_override_pattern": _TINY_PATTERN,
    "num_hidden_layers": len(_TINY_PATTERN),
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1536,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 12,
    "mamba_head_dim": 64,
    "ssm_state_size": 64,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 64,
    "expand": 2,
    # SGLang 0.5.23's NemotronHConfig reads only the mamba_-prefixed names (transformers takes both)
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 64,
    "mamba_expand": 2,
    "time_step_min": 0.001,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
    "max_position_embeddings": 65536,
}

_SMALL_PATTERN = "M-M-M-M-*-M-M-M-M-M-M-M-M-*-M-M-M-M-"

#: ~149M parameters: 16 Mamba-2 + 2 attention + 18 MLP layers, D 768.
SMALL_CONFIG: dict[str, Any] = {
    **TINY_CONFIG,
    "hidden_size": 768,
    "hybrid_override_pattern": _SMALL_PATTERN,
    "num_hidden_layers": len(_SMALL_PATTERN),
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "mamba_num_heads": 24,
    "intermediate_size": 3072,
    "chunk_size": 128,
    "mamba_chunk_size": 128,
}

TINY_JAMBA_CONFIG: dict[str, Any] = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 16,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,
}


class _Init:
    """Seeded initialisers producing HF-named tensors."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.out: dict[str, torch.Tensor] = {}

    def normal(self, name: str, *shape: int, std: float = 0.02) -> None:
        self.out[name] = torch.randn(*shape, generator=self.g) * std

    def uniform(self, name: str, *shape: int, lo: float, hi: float) -> torch.Tensor:
        t = lo + (hi - lo) * torch.rand(*shape, generator=self.g)
        self.out[name] = t
        return t

    def ones(self, name: str, *shape: int) -> None:
        self.out[name] = torch.ones(*shape)

    def log_uniform(self, *shape: int, lo: float, hi: float) -> torch.Tensor:
        u = torch.rand(*shape, generator=self.g)
        return torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))

    def dt_bias(self, name: str, n: int) -> None:
        dt = self.log_uniform(n, lo=1e-3, hi=0.1)
        self.out[name] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus

    def attention(self, p: str, cfg: dict[str, Any]) -> None:
        h, d = (
            cfg["hidden_size"],
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        )
        self.normal(p + "q_proj.weight", cfg["num_attention_heads"] * d, h)
        self.normal(p + "k_proj.weight", cfg["num_key_value_heads"] * d, h)
        self.normal(p + "v_proj.weight", cfg["num_key_value_heads"] * d, h)
        self.normal(p + "o_proj.weight", h, cfg["num_attention_heads"] * d)


def _tiny_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    w = _Init(seed)
    h = cfg["hidden_size"]
    w.normal("backbone.embeddings.weight", VOCAB, h, std=1.0)
    nh, hd, n, g, k = (
        cfg[x]
        for x in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel")
    )
    inner, conv_dim = nh * hd, nh * hd + 2 * g * n
    for i, t in enumerate(cfg["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}."
        w.ones(p + "norm.weight", h)
        m = p + "mixer."
        if t == "M":
            w.normal(m + "in_proj.weight", inner + conv_dim + nh, h)
            w.uniform(m + "conv1d.weight", conv_dim, 1, k, lo=-0.5, hi=0.5)
            w.uniform(m + "conv1d.bias", conv_dim, lo=-0.1, hi=0.1)
            w.dt_bias(m + "dt_bias", nh)
            w.out[m + "A_log"] = torch.log(w.log_uniform(nh, lo=0.01, hi=0.1))
            w.ones(m + "D", nh)
            w.ones(m + "norm.weight", inner)
            w.normal(m + "out_proj.weight", h, inner)
        elif t == "*":
            w.attention(m, cfg)
        else:
            w.normal(m + "up_proj.weight", cfg["intermediate_size"], h)
            w.normal(m + "down_proj.weight", h, cfg["intermediate_size"])
    w.ones("backbone.norm_f.weight", h)
    w.normal("lm_head.weight", VOCAB, h)
    return w.out


def _tiny_jamba_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    w = _Init(seed)
    h, inter, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["mamba_d_state"]
    d, r, k = cfg["mamba_expand"] * h, cfg["mamba_dt_rank"], cfg["mamba_d_conv"]
    w.normal("model.embed_tokens.weight", VOCAB, h, std=1.0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.ones(p + "input_layernorm.weight", h)
        w.ones(p + "pre_ff_layernorm.weight", h)
        if i % cfg["attn_layer_period"] == cfg["attn_layer_offset"]:
            w.attention(p + "self_attn.", cfg)
        else:
            m = p + "mamba."
            w.normal(m + "in_proj.weight", 2 * d, h)
            w.uniform(m + "conv1d.weight", d, 1, k, lo=-0.5, hi=0.5)
            w.uniform(m + "conv1d.bias", d, lo=-0.1, hi=0.1)
            w.normal(m + "x_proj.weight", r + 2 * n, d)
            w.normal(m + "dt_proj.weight", d, r, std=r**-0.5)
            w.dt_bias(m + "dt_proj.bias", d)
            w.out[m + "A_log"] = torch.log(w.log_uniform(d, n, lo=0.01, hi=0.1))
            w.ones(m + "D", d)
            w.normal(m + "out_proj.weight", h, d)
            for x, dim in (("dt", r), ("b", n), ("c", n)):
                w.ones(m + f"{x}_layernorm.weight", dim)
        f = p + "feed_forward."
        if i % cfg["expert_layer_period"] == cfg["expert_layer_offset"]:
            w.normal(f + "router.weight", cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                w.normal(f + f"experts.{e}.gate_proj.weight", inter, h)
                w.normal(f + f"experts.{e}.up_proj.weight", inter, h)
                w.normal(f + f"experts.{e}.down_proj.weight", h, inter)
        else:
            w.normal(f + "gate_proj.weight", inter, h)
            w.normal(f + "up_proj.weight", inter, h)
            w.normal(f + "down_proj.weight", h, inter)
    w.ones("model.final_layernorm.weight", h)
    w.normal("lm_head.weight", VOCAB, h)
    return w.out


TINY_MODELS: dict[
    str, tuple[dict[str, Any], Callable[[dict[str, Any], int], dict[str, torch.Tensor]]]
] = {
    "tiny": (TINY_CONFIG, _tiny_weights),
    "tiny-jamba": (TINY_JAMBA_CONFIG, _tiny_jamba_weights),
    "small": (SMALL_CONFIG, _tiny_weights),
}


def ensure_tiny(name: str = "tiny", seed: int = 0) -> Path:
    """The folder of embedded model `name`, created (deterministically from `seed`) if absent."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {sorted(TINY_MODELS)}")
    path = cache_dir() / "models" / name
    cfg, make = TINY_MODELS[name]
    if (path / WEIGHTS).is_file():
        write_metadata(path, cfg)  # folders from older versions gain the tokenizer files
        return path
    return write_hf_folder(path, cfg, make(cfg, seed))

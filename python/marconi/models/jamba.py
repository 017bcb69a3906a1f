"""Jamba: Mamba-1 mixers with attention every `attn_layer_period` layers, MoE every
`expert_layer_period` layers."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from marconi.models.config import HybridConfig, SublayerSpec, spec
from marconi.models.hybrid import HybridForCausalLM, WeightRule, rules
from marconi.models.mamba2_hybrid import BAMBA_RULES, _attention, _config

_FF = r"model\.layers\.(?P<i>\d+)\.feed_forward\."
JAMBA_RULES = rules(
    (_FF + r"router\.weight", "layers.{f}.mixer.router.weight"),
    (_FF + r"experts\.(?P<e>\d+)\.gate_proj\.weight",
     "layers.{f}.mixer.experts_gate_up@{e}#0"),
    (_FF + r"experts\.(?P<e>\d+)\.up_proj\.weight",
     "layers.{f}.mixer.experts_gate_up@{e}#1"),
    (_FF + r"experts\.(?P<e>\d+)\.down_proj\.weight",
     "layers.{f}.mixer.experts_down@{e}"),
    (_FF + r"experts\.gate_up_proj", "layers.{f}.mixer.experts_gate_up"),
    (_FF + r"experts\.down_proj", "layers.{f}.mixer.experts_down"),
) + BAMBA_RULES  # fmt: skip


class JambaForCausalLM(HybridForCausalLM):
    """Jamba on our runtime (see HybridForCausalLM)."""

    architectures: ClassVar[tuple[str, ...]] = ("JambaForCausalLM",)

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> HybridConfig:
        hidden = hf["hidden_size"]
        eps = hf.get("rms_norm_eps", 1e-6)
        rank = hf.get("mamba_dt_rank", "auto")
        act = hf.get("hidden_act", "silu")
        mamba = spec(
            "mamba1",
            hidden=hidden,
            d_inner=hf.get("mamba_expand", 2) * hidden,
            d_state=hf.get("mamba_d_state", 16),
            d_conv=hf.get("mamba_d_conv", 4),
            dt_rank=math.ceil(hidden / 16) if rank == "auto" else rank,
            eps=eps,
            conv_bias=bool(hf.get("mamba_conv_bias", True)),
            proj_bias=bool(hf.get("mamba_proj_bias", False)),
            act=act,
        )
        inter = hf.get("intermediate_size", 14336)
        mlp = spec("mlp", hidden=hidden, intermediate=inter, act=act, gated=True)
        experts = hf.get("num_experts", 16)
        moe = spec(
            "moe", hidden=hidden, intermediate=inter, num_experts=experts,
            top_k=hf.get("num_experts_per_tok", 2), act=act, gated=True, router="softmax_topk",
        )  # fmt: skip
        a_per, a_off = hf.get("attn_layer_period", 8), hf.get("attn_layer_offset", 4)
        e_per, e_off = hf.get("expert_layer_period", 2), hf.get("expert_layer_offset", 1)
        subs: list[SublayerSpec] = []
        for i in range(hf["num_hidden_layers"]):
            subs.append(_attention(hf) if i % a_per == a_off else mamba)
            subs.append(moe if experts > 1 and i % e_per == e_off else mlp)
        return _config("JambaForCausalLM", hf, eps, subs)

    @classmethod
    def weight_rules(cls, config: HybridConfig) -> tuple[WeightRule, ...]:
        return JAMBA_RULES

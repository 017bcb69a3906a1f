"""Jamba: Mamba-1 mixers with attention every `attn_layer_period` layers, MoE every
`expert_layer_period` layers."""

from __future__ import annotations

from typing import Any, ClassVar

from marconi.cache.hf_config import attention_shape, jamba_layout, jamba_mamba
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
        act = hf.get("hidden_act", "silu")
        shape = jamba_mamba(hf)  # dimensions from the one config parser
        mamba = spec(
            "mamba1",
            hidden=hidden,
            d_inner=shape.d_inner,
            d_state=shape.d_state,
            d_conv=shape.d_conv,
            dt_rank=shape.dt_rank,
            eps=eps,
            conv_bias=bool(hf.get("mamba_conv_bias", True)),
            proj_bias=bool(hf.get("mamba_proj_bias", False)),
            act=act,
        )
        inter = hf.get("intermediate_size", 14336)
        mlp = spec("mlp", hidden=hidden, intermediate=inter, act=act, gated=True)
        moe = spec(
            "moe", hidden=hidden, intermediate=inter, num_experts=hf.get("num_experts", 16),
            top_k=hf.get("num_experts_per_tok", 2), act=act, gated=True, router="softmax_topk",
        )  # fmt: skip
        attn = _attention(attention_shape(hf), hf)
        subs: list[SublayerSpec] = []
        for is_attn, is_moe in jamba_layout(hf):
            subs += [attn if is_attn else mamba, moe if is_moe else mlp]
        return _config("JambaForCausalLM", hf, eps, subs)

    @classmethod
    def weight_rules(cls, config: HybridConfig) -> tuple[WeightRule, ...]:
        return JAMBA_RULES

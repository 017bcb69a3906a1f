"""The Mamba-2 hybrid family: Nemotron-H, Granite-4.0-hybrid and Bamba, one class.

The three differ only in config field names, layer layout, RoPE, MLP/MoE flavour, Granite's
multipliers and tensor names; each is a `parse_config` + `weight_rules` pair below.
"""

from __future__ import annotations

from typing import Any, ClassVar

from marconi.cache.hf_config import (
    NEMOTRON_H_DEFAULTS,
    attention_shape,
    layer_kinds,
    nemotron_h_fields,
    nemotron_h_mamba,
    prefixed_mamba2,
)
from marconi.cache.shapes import AttentionShape, SSMShape
from marconi.cache.spec import cache_spec_from_hf
from marconi.models.config import HybridConfig, SublayerSpec, hf_float, rope_theta, spec
from marconi.models.hybrid import HybridForCausalLM, WeightRule, rules


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Per-layer kinds (``ssm``/``attention``/``mlp``/``moe``) from the one config parser."""
    kinds = layer_kinds(hf, [])
    if not kinds:
        raise ValueError("config has no layer types (layer_types / hybrid_override_pattern)")
    return kinds


def _mamba2(shape: SSMShape, hf: dict[str, Any], eps: float, **names: str) -> SublayerSpec:
    """Mamba-2 spec: dimensions from the config parser's ``shape``, runtime-only fields (chunk
    size, biases, dt limit, activation) from ``hf`` (``names`` renames them for Nemotron-H)."""

    def get(field: str, default: Any) -> Any:
        return hf.get(names.get(field, field), default)

    limit = get("time_step_limit", (0.0, float("inf")))
    return spec(
        "mamba2",
        hidden=shape.in_dim,
        num_heads=shape.num_heads,
        head_dim=shape.head_dim,
        n_groups=shape.n_groups,
        d_state=shape.d_state,
        d_conv=shape.d_conv,
        chunk_size=get("mamba_chunk_size", 256),
        eps=eps,
        conv_bias=bool(get("mamba_conv_bias", True)),
        proj_bias=bool(get("mamba_proj_bias", False)),
        dt_limit=(hf_float(limit[0]), hf_float(limit[1])),
        act=get("hidden_act", "silu"),
    )


def _attention(shape: AttentionShape, hf: dict[str, Any], **extra: Any) -> SublayerSpec:
    return spec(
        "attention",
        hidden=shape.out_dim,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        bias=bool(hf.get("attention_bias", False)),
        **extra,
    )


def _nemotron_h(hf: dict[str, Any]) -> HybridConfig:
    eps = hf.get("layer_norm_epsilon", 1e-5)
    hidden = hf["hidden_size"]
    if hf.get("moe_latent_size") is not None:
        raise ValueError("Nemotron-H with moe_latent_size is not supported")
    nm = {  # runtime-only fields under Nemotron-H's names
        "mamba_chunk_size": "chunk_size",
        "mamba_conv_bias": "use_conv_bias",
        "mamba_proj_bias": "use_bias",
        "hidden_act": "mamba_hidden_act",
    }
    # dt is clamped to ``time_step_limit`` (default (0, inf): no clamp), as in vLLM, SGLang and
    # transformers >= 5.25 (up to 5.24, transformers clamped at (time_step_min, inf) instead)
    fields = nemotron_h_fields(hf)
    mamba = _mamba2(nemotron_h_mamba(fields), fields, eps, **nm)
    attn = attention_shape(fields, head_dim=NEMOTRON_H_DEFAULTS["head_dim"])
    act = hf.get("mlp_hidden_act", "relu2")
    subs: list[SublayerSpec] = []
    for t in _layer_types(hf):
        if t == "ssm":
            subs.append(mamba)
        elif t == "attention":
            subs.append(_attention(attn, {}))  # Nemotron-H attention has no bias
        elif t == "mlp":
            subs.append(
                spec("mlp", hidden=hidden, intermediate=hf.get("intermediate_size", 21504),
                     act=act, gated=False, bias=bool(hf.get("mlp_bias", False)))
            )  # fmt: skip
        else:
            subs.append(
                spec(
                    "moe",
                    hidden=hidden,
                    intermediate=hf.get("moe_intermediate_size", 7688),
                    num_experts=hf.get("n_routed_experts", 8),
                    top_k=hf.get("num_experts_per_tok", 2),
                    act=act,
                    gated=False,
                    router="sigmoid_group",
                    shared_intermediate=hf.get("moe_shared_expert_intermediate_size", 7688),
                    norm_topk=bool(hf.get("norm_topk_prob", True)),
                    routed_scaling=float(hf.get("routed_scaling_factor", 1.0)),
                    n_group=hf.get("n_group", 1),
                    topk_group=hf.get("topk_group", 1),
                )
            )
    return _config("NemotronHForCausalLM", hf, eps, subs)


def _config(
    arch: str, hf: dict[str, Any], eps: float, subs: list[SublayerSpec], **kw: Any
) -> HybridConfig:
    eos = hf.get("eos_token_id")
    return HybridConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        norm_eps=eps,
        sublayers=tuple(subs),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        bos_token_id=hf.get("bos_token_id"),
        hf=hf,
        cache_spec=cache_spec_from_hf(hf),
        **kw,
    )


def _granite(hf: dict[str, Any]) -> HybridConfig:
    eps = hf.get("rms_norm_eps", 1e-6)
    hidden = hf["hidden_size"]
    rope: dict[str, Any] = {"scaling": float(hf.get("attention_multiplier", 1.0))}
    if hf.get("position_embedding_type") == "rope":
        rope["rope_theta"] = rope_theta(hf)
    experts = hf.get("num_local_experts", 8)
    shared = hf.get("shared_intermediate_size", 1024)
    act = hf.get("hidden_act", "silu")
    if experts > 0:
        ffn = spec(
            "moe", hidden=hidden, intermediate=hf.get("intermediate_size", 11008),
            num_experts=experts, top_k=hf.get("num_experts_per_tok", 2), act=act, gated=True,
            router="topk_softmax", shared_intermediate=shared,
        )  # fmt: skip
    else:
        ffn = spec("mlp", hidden=hidden, intermediate=shared, act=act, gated=True)
    mamba, attn = _mamba2(prefixed_mamba2(hf), hf, eps), _attention(attention_shape(hf), hf, **rope)
    subs: list[SublayerSpec] = []
    for t in _layer_types(hf):
        subs += [mamba if t == "ssm" else attn, ffn]
    return _config(
        "GraniteMoeHybridForCausalLM",
        hf,
        eps,
        subs,
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        logits_scaling=float(hf.get("logits_scaling", 1.0)),
    )


def _bamba(hf: dict[str, Any]) -> HybridConfig:
    eps = hf.get("rms_norm_eps", 1e-5)
    attn_at = set(hf.get("attn_layer_indices") or [])
    rp = hf.get("rope_parameters") or {}
    rope = {
        "rope_theta": rope_theta(hf),
        "rope_partial": float(rp.get("partial_rotary_factor", 0.5)),
    }
    mlp = spec(
        "mlp", hidden=hf["hidden_size"], intermediate=hf.get("intermediate_size", 14336),
        act=hf.get("hidden_act", "silu"), gated=True, bias=bool(hf.get("mlp_bias", False)),
    )  # fmt: skip
    mamba, attn = _mamba2(prefixed_mamba2(hf), hf, eps), _attention(attention_shape(hf), hf, **rope)
    subs: list[SublayerSpec] = []
    for i in range(hf["num_hidden_layers"]):
        subs += [attn if i in attn_at else mamba, mlp]
    return _config("BambaForCausalLM", hf, eps, subs)


_NM = r"(?:backbone|model)\.layers\.(?P<i>\d+)\.mixer\."
_L = r"model\.layers\.(?P<i>\d+)\."
_NEMOTRON_RULES = rules(
    (r"(?:backbone|model)\.embeddings\.weight", "embed.weight"),
    (r"(?:backbone|model)\.norm_f\.weight", "final_norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"(?:backbone|model)\.layers\.(?P<i>\d+)\.norm\.weight", "layers.{n}.norm.weight"),
    (_NM + r"experts\.(?P<e>\d+)\.(?P<p>up|down)_proj\.weight",
     "layers.{n}.mixer.experts_{p}@{e}"),
    (_NM + r"experts\.(?P<p>up|down)_proj",
     "layers.{n}.mixer.experts_{p}"),
    (_NM + r"gate\.weight", "layers.{n}.mixer.router.weight"),
    (_NM + r"gate\.e_score_correction_bias",
     "layers.{n}.mixer.router_bias"),
    (_NM + r"shared_experts\.(?P<p>up|down)_proj\.weight",
     "layers.{n}.mixer.shared.{p}.weight"),
    (_NM + r"(?P<p>up|down)_proj\.(?P<w>weight|bias)",
     "layers.{n}.mixer.{p}.{w}"),
    (_NM + r"(?P<rest>.+)", "layers.{n}.mixer.{rest}"),
)  # fmt: skip

_COMMON = (
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (_L + r"input_layernorm\.weight", "layers.{m}.norm.weight"),
    (_L + r"(?:mamba|self_attn)\.(?P<rest>.+)", "layers.{m}.mixer.{rest}"),
)
_GATED_MLP = (
    (_L + r"feed_forward\.gate_proj\.weight", "layers.{f}.mixer.gate_up.weight#0"),
    (_L + r"feed_forward\.up_proj\.weight", "layers.{f}.mixer.gate_up.weight#1"),
    (_L + r"feed_forward\.down_proj\.weight", "layers.{f}.mixer.down.weight"),
)  # fmt: skip
BAMBA_RULES = rules(
    *_COMMON,
    *_GATED_MLP,
    (r"model\.final_layernorm\.weight", "final_norm.weight"),
    (_L + r"pre_ff_layernorm\.weight", "layers.{f}.norm.weight"),
)


def _granite_rules(has_experts: bool) -> tuple[WeightRule, ...]:
    shared = "shared." if has_experts else ""
    moe = _L + r"block_sparse_moe\."
    return rules(
        *_COMMON,
        (r"model\.norm\.weight", "final_norm.weight"),
        (_L + r"post_attention_layernorm\.weight", "layers.{f}.norm.weight"),
        (moe + r"(?:input_linear\.weight|experts\.gate_up_proj)",
         "layers.{f}.mixer.experts_gate_up"),
        (moe + r"(?:output_linear\.weight|experts\.down_proj)",
         "layers.{f}.mixer.experts_down"),
        (moe + r"router\.(?:layer\.)?weight", "layers.{f}.mixer.router.weight"),
        (_L + r"shared_mlp\.input_linear\.weight",
         "layers.{f}.mixer." + shared + "gate_up.weight"),
        (_L + r"shared_mlp\.output_linear\.weight",
         "layers.{f}.mixer." + shared + "down.weight"),
    )  # fmt: skip


class Mamba2HybridForCausalLM(HybridForCausalLM):
    """Nemotron-H / Granite-4.0-hybrid / Bamba on our runtime (see HybridForCausalLM)."""

    architectures: ClassVar[tuple[str, ...]] = (
        "NemotronHForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "BambaForCausalLM",
    )

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> HybridConfig:
        arch = (hf.get("architectures") or [""])[0]
        parse = {
            "NemotronHForCausalLM": _nemotron_h,
            "GraniteMoeHybridForCausalLM": _granite,
            "BambaForCausalLM": _bamba,
        }.get(arch)
        if parse is None:
            raise ValueError(f"{arch!r} is not a Mamba-2 hybrid architecture")
        return parse(hf)

    @classmethod
    def weight_rules(cls, config: HybridConfig) -> tuple[WeightRule, ...]:
        if config.architecture == "NemotronHForCausalLM":
            return _NEMOTRON_RULES
        if config.architecture == "BambaForCausalLM":
            return BAMBA_RULES
        return _granite_rules(config.hf.get("num_local_experts", 8) > 0)

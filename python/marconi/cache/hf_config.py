"""Layer shapes of a hybrid LLM, parsed from a Hugging Face ``config.json`` dict.

Only the fields that decide FLOPs and cache bytes are read; no weights, no ``transformers``.
One parser per architecture, chosen from ``PARSERS`` by ``config["architectures"][0]`` (or by
``model_type``); anything else with attention heads is parsed as a dense Llama-style transformer.
Field names and defaults follow transformers 5.x ``configuration_*.py`` / ``modeling_*.py``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from marconi.cache.shapes import (
    AttentionShape,
    LinearShape,
    MLPShape,
    MoEShape,
    ParsedConfig,
    SSMShape,
)

Config = dict[str, Any]
Parser = Callable[[Config], "ParsedConfig"]


def _group(items: Iterable[Any]) -> tuple[Any, ...]:
    """Merge identical shapes (ignoring count) into one shape with the summed count."""
    counts: Counter[Any] = Counter()
    for item in items:
        counts[(type(item), tuple(vars(item).items())[1:])] += item.count
    return tuple(cls(count, **dict(rest)) for (cls, rest), count in counts.items())


def _get(cfg: Config, *keys: str, default: Any = None) -> Any:
    """First present, non-None value among ``keys``."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _dtype(cfg: Config) -> str:
    # transformers 5 writes "dtype", 4.x "torch_dtype"; no field -> assume bf16 serving.
    return str(_get(cfg, "dtype", "torch_dtype", default="bfloat16")).removeprefix("torch.")


def _ssm_dtype(cfg: Config) -> str:
    # transformers' Mamba scans (torch fallback and mamba_ssm kernels) return an fp32 final state
    # and the cache keeps it as is, so fp32 unless the config names a cache dtype ("auto" is
    # vLLM's spelling of "same as the model").
    value = cfg.get("mamba_ssm_cache_dtype")
    if value is None:
        return "float32"
    return _dtype(cfg) if value == "auto" else str(value).removeprefix("torch.")


def attention_shape(
    cfg: Config, count: int = 1, in_dim: int | None = None, head_dim: int | None = None
) -> AttentionShape:
    """An attention mixer from the usual HF fields; ``head_dim`` is the architecture's default
    when the config has none (hidden // heads if None)."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(_get(cfg, "head_dim", default=head_dim or hidden // heads))
    kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
    return AttentionShape(count, in_dim or hidden, hidden, heads, kv_heads, head_dim)


def _mamba2(
    cfg: Config, count: int, d_inner: int, keys: tuple[str, ...], *defaults: Any
) -> SSMShape:
    """Mamba-2 mixer; ``keys`` name the config fields of (num_heads, head_dim, d_state, d_conv,
    n_groups) with ``defaults``; a head_dim of None/"auto" means d_inner // num_heads."""
    heads, head_dim, d_state, d_conv, groups = (
        _get(cfg, k, default=d) for k, d in zip(keys, defaults, strict=True)
    )
    head_dim = int(d_inner) // int(heads) if head_dim in (None, "auto") else int(head_dim)
    if int(heads) * head_dim != d_inner:
        raise ValueError(f"mamba heads {heads} x head_dim {head_dim} != d_inner {d_inner}")
    hidden = int(cfg["hidden_size"])
    return SSMShape(
        count,
        "mamba2",
        hidden,
        d_inner,
        int(d_state),
        int(d_conv),
        int(heads),
        head_dim,
        int(groups),
    )


def _mamba1(cfg: Config, count: int, keys: tuple[str, ...], *defaults: Any) -> SSMShape:
    """Mamba-1 mixer; ``keys`` name the fields of (expand, d_state, d_conv, dt_rank)."""
    expand, d_state, d_conv, rank = (
        _get(cfg, k, default=d) for k, d in zip(keys, defaults, strict=True)
    )
    hidden = int(cfg["hidden_size"])
    rank = math.ceil(hidden / 16) if rank == "auto" else int(rank)
    return SSMShape(
        count, "mamba1", hidden, int(expand) * hidden, int(d_state), int(d_conv), dt_rank=rank
    )


def layer_kind(name: str) -> str:
    """Normalise a per-layer type name (old and new transformers spellings, pattern chars)."""
    table = {
        "M": "ssm", "mamba": "ssm", "mamba2": "ssm", "linear_attention": "ssm",
        "*": "attention", "attention": "attention", "full_attention": "attention",
        "-": "mlp", "mlp": "mlp", "E": "moe", "moe": "moe", "hybrid": "hybrid",
    }  # fmt: skip
    if name not in table:
        raise ValueError(f"unknown layer type {name!r}")
    return table[name]


def _finish(cfg: Config, layers: list[Any]) -> ParsedConfig:
    groups = {cls: _group(x for x in layers if isinstance(x, cls))
              for cls in (AttentionShape, MLPShape, MoEShape, SSMShape, LinearShape)}  # fmt: skip
    return ParsedConfig(
        hidden_size=int(cfg["hidden_size"]),
        attention=groups[AttentionShape],
        mlp=groups[MLPShape],
        moe=groups[MoEShape],
        ssm=groups[SSMShape],
        linear=groups[LinearShape],
        dtype=_dtype(cfg),
        ssm_state_dtype=_ssm_dtype(cfg),
    )


PARSERS: dict[str, Callable[[Config], ParsedConfig]] = {}
MODEL_TYPES: dict[str, str] = {}  # config "model_type" -> architecture, for configs without one


def _register(arch: str, model_type: str) -> Callable[[Parser], Parser]:
    def add(parser: Parser) -> Parser:
        PARSERS[arch], MODEL_TYPES[model_type] = parser, arch
        return parser

    return add


def parse_transformer(cfg: Config) -> ParsedConfig:
    """Llama-style dense (or Mixtral-style MoE) decoder: attention + gated MLP in every layer."""
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    experts = int(_get(cfg, "num_local_experts", "num_experts", default=0))
    ffn: Any = MLPShape(n, hidden, int(cfg["intermediate_size"]), gated=True)
    if experts > 1:
        inter = int(_get(cfg, "moe_intermediate_size", "intermediate_size"))
        ffn = MoEShape(n, hidden, experts, int(cfg["num_experts_per_tok"]), inter, gated=True)
    return _finish(cfg, [attention_shape(cfg, n), ffn])


def jamba_mamba(cfg: Config) -> SSMShape:
    """Jamba's Mamba-1 mixer (transformers ``JambaConfig`` defaults)."""
    keys = ("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank")
    return _mamba1(cfg, 1, keys, 2, 16, 4, "auto")


def jamba_layout(cfg: Config) -> list[tuple[bool, bool]]:
    """Per layer: (attention mixer?, MoE feed-forward?) from the attention and expert periods;
    MoE only with more than one expert."""
    a_per, a_off = int(cfg.get("attn_layer_period", 8)), int(cfg.get("attn_layer_offset", 4))
    e_per, e_off = int(cfg.get("expert_layer_period", 2)), int(cfg.get("expert_layer_offset", 1))
    moe = int(cfg.get("num_experts", 16)) > 1
    n = int(cfg["num_hidden_layers"])
    return [(i % a_per == a_off, moe and i % e_per == e_off) for i in range(n)]


@_register("JambaForCausalLM", "jamba")
def parse_jamba(cfg: Config) -> ParsedConfig:
    """Jamba: Mamba-1 + attention every ``attn_layer_period``; MoE every ``expert_layer_period``."""
    hidden = int(cfg["hidden_size"])
    mamba = jamba_mamba(cfg)
    experts, inter = int(cfg.get("num_experts", 16)), int(cfg["intermediate_size"])
    moe = MoEShape(1, hidden, experts, int(cfg.get("num_experts_per_tok", 2)), inter, gated=True)
    mlp = MLPShape(1, hidden, inter, gated=True)
    layers: list[Any] = []
    for is_attn, is_moe in jamba_layout(cfg):
        layers += [attention_shape(cfg, 1) if is_attn else mamba, moe if is_moe else mlp]
    return _finish(cfg, layers)


def layer_kinds(cfg: Config, default: list[str]) -> list[str]:
    """Per-layer kinds (``ssm``, ``attention``, ``mlp``, ``moe``, ``hybrid``) from
    ``layers_block_type`` / ``layer_types`` / ``hybrid_override_pattern`` (old and new
    transformers spellings), else ``default``."""
    kinds = _get(
        cfg, "layers_block_type", "layer_types", "hybrid_override_pattern", default=default
    )
    return [layer_kind(k) for k in kinds]  # a pattern string iterates as characters


#: Nemotron-H's older ``mamba_*`` spellings -> transformers' names (``NemotronHConfig``, which
#: lets the old spelling win when present, as here)
_NEMOTRON_ALIASES = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_chunk_size": "chunk_size",
}  # fmt: skip
#: transformers ``NemotronHConfig`` defaults of the cache-shaping fields
NEMOTRON_H_DEFAULTS = {
    "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "conv_kernel": 4,
    "n_groups": 8, "chunk_size": 128, "head_dim": 128,
}  # fmt: skip


def nemotron_h_fields(cfg: Config) -> Config:
    """``cfg`` with the Nemotron-H fields under transformers' names, defaults filled in."""
    renamed = {new: cfg[old] for old, new in _NEMOTRON_ALIASES.items() if old in cfg}
    return NEMOTRON_H_DEFAULTS | cfg | renamed


def nemotron_h_mamba(cfg: Config) -> SSMShape:
    """Nemotron-H's Mamba-2 mixer (``cfg`` from ``nemotron_h_fields``)."""
    d_inner = int(cfg["mamba_num_heads"]) * int(cfg["mamba_head_dim"])
    keys = ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "conv_kernel", "n_groups")
    return _mamba2(cfg, 1, d_inner, keys, *(NEMOTRON_H_DEFAULTS[k] for k in keys))


@_register("NemotronHForCausalLM", "nemotron_h")
def parse_nemotron_h(cfg: Config) -> ParsedConfig:
    """Nemotron-H: one mixer per layer from the pattern (M=Mamba-2, *=attention, -=MLP, E=MoE)."""
    cfg = nemotron_h_fields(cfg)
    hidden = int(cfg["hidden_size"])
    mamba = nemotron_h_mamba(cfg)
    shared = int(cfg.get("moe_shared_expert_intermediate_size", 7688))
    moe = MoEShape(
        1,
        hidden,
        int(cfg.get("n_routed_experts", 8)),
        int(cfg.get("num_experts_per_tok", 2)),
        int(cfg.get("moe_intermediate_size", 7688)),
        gated=False,
        shared_intermediate=shared if int(cfg.get("n_shared_experts", 1)) > 0 else 0,
        shared_gated=False,
        latent_dim=int(cfg.get("moe_latent_size") or 0),
    )
    by_kind = {
        "ssm": mamba,
        "attention": attention_shape(cfg, 1, head_dim=NEMOTRON_H_DEFAULTS["head_dim"]),
        "mlp": MLPShape(1, hidden, int(cfg.get("intermediate_size", 21504)), gated=False),
        "moe": moe,
    }
    default = ["ssm", "moe", "attention", "mlp"]
    layers = [by_kind[k] for k in layer_kinds(cfg, default)]
    return _finish(cfg, layers)


def prefixed_mamba2(cfg: Config, d_inner: int | None = None, count: int = 1) -> SSMShape:
    """Mamba-2 mixer from Bamba / Granite / Falcon-H1 style ``mamba_*`` fields; ``d_inner``
    defaults to ``mamba_expand * hidden_size``."""
    d_inner = d_inner or int(cfg.get("mamba_expand", 2)) * int(cfg["hidden_size"])
    keys = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_d_conv", "mamba_n_groups")
    return _mamba2(cfg, count, d_inner, keys, 128, "auto", 256, 4, 1)


@_register("BambaForCausalLM", "bamba")
def parse_bamba(cfg: Config) -> ParsedConfig:
    """Bamba: attention at ``attn_layer_indices``, Mamba-2 elsewhere; gated MLP in every layer."""
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    attn_ids = set(cfg.get("attn_layer_indices") or [])
    mamba = prefixed_mamba2(cfg)
    mlp = MLPShape(n, hidden, int(cfg["intermediate_size"]), gated=True)
    mixers = [attention_shape(cfg, 1) if i in attn_ids else mamba for i in range(n)]
    return _finish(cfg, [*mixers, mlp])


@_register("GraniteMoeHybridForCausalLM", "granitemoehybrid")
def parse_granite_hybrid(cfg: Config) -> ParsedConfig:
    """Granite-4.0-hybrid: ``layer_types`` mixers; every layer MoE (if experts) + shared MLP."""
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    mamba = prefixed_mamba2(cfg)
    kinds = layer_kinds(cfg, ["ssm"] * n)
    mixers = [attention_shape(cfg, 1) if k == "attention" else mamba for k in kinds]
    shared = int(cfg.get("shared_intermediate_size", 1024))
    experts = int(cfg.get("num_local_experts") or 0)
    ffn: Any = MLPShape(len(kinds), hidden, shared, gated=True)
    if experts > 0:
        ffn = MoEShape(
            len(kinds),
            hidden,
            experts,
            int(cfg.get("num_experts_per_tok", 2)),
            int(cfg["intermediate_size"]),
            gated=True,
            shared_intermediate=shared,
        )
    return _finish(cfg, [*mixers, ffn])


@_register("FalconH1ForCausalLM", "falcon_h1")
def parse_falcon_h1(cfg: Config) -> ParsedConfig:
    """Falcon-H1: attention and Mamba-2 in parallel in every layer, then a gated MLP."""
    n, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    d_inner = cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand", 2)) * hidden
    layers = [
        attention_shape(cfg, n),
        prefixed_mamba2(cfg, int(d_inner), count=n),
        MLPShape(n, hidden, int(cfg["intermediate_size"]), gated=True),
    ]
    return _finish(cfg, layers)


@_register("Zamba2ForCausalLM", "zamba2")
def parse_zamba2(cfg: Config) -> ParsedConfig:
    """Zamba2: Mamba-2 in every layer; "hybrid" layers first run the shared transformer block
    (attention over [h, embeddings] = 2*hidden inputs, gated MLP) and a hidden->hidden linear.
    Shared weights, but each hybrid layer keeps its own KV. LoRA adapters are ignored."""
    hidden = int(cfg["hidden_size"])
    d_inner = int(cfg.get("mamba_expand", 2)) * hidden
    keys = ("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_d_conv", "mamba_ngroups")
    mamba = _mamba2(cfg, 1, d_inner, keys, 8, None, 64, 4, 1)
    attn_heads = int(cfg.get("num_attention_heads", 32))
    kv_heads = int(_get(cfg, "num_key_value_heads", default=attn_heads))
    attn = AttentionShape(1, 2 * hidden, hidden, attn_heads, kv_heads, 2 * hidden // attn_heads)
    mlp = MLPShape(1, hidden, int(cfg.get("intermediate_size") or 4 * hidden), gated=True)
    default = ["ssm"] + (["ssm"] * 5 + ["hybrid"]) * 7 + ["ssm"] * 4 + ["hybrid"] + ["ssm"] * 3
    default += ["hybrid"] + ["ssm"] * 2
    layers: list[Any] = []
    for kind in layer_kinds(cfg, default):
        if kind == "hybrid":
            layers += [attn, mlp, LinearShape(1, hidden, hidden)]
        layers.append(mamba)
    return _finish(cfg, layers)


@_register("Mamba2ForCausalLM", "mamba2")
def parse_mamba2(cfg: Config) -> ParsedConfig:
    """Pure Mamba-2 (HF ``Mamba2ForCausalLM`` fields)."""
    hidden = int(cfg["hidden_size"])
    n = int(cfg["num_hidden_layers"])
    keys = ("num_heads", "head_dim", "state_size", "conv_kernel", "n_groups")
    mamba = _mamba2(cfg, n, int(cfg.get("expand", 2)) * hidden, keys, 128, 64, 128, 4, 8)
    return _finish(cfg, [mamba])


@_register("MambaForCausalLM", "mamba")
def parse_mamba(cfg: Config) -> ParsedConfig:
    """Pure Mamba-1 (HF ``MambaForCausalLM`` fields)."""
    keys = ("expand", "state_size", "conv_kernel", "time_step_rank")
    return _finish(cfg, [_mamba1(cfg, int(cfg["num_hidden_layers"]), keys, 2, 16, 4, "auto")])


def _from_mamba_ssm(cfg: Config) -> Config:
    """Translate a ``mamba_ssm`` ``config.json`` (d_model, n_layer, ssm_cfg) to HF Mamba/Mamba2."""
    ssm = cfg.get("ssm_cfg") or {}
    hf = {
        "hidden_size": cfg["d_model"], "num_hidden_layers": cfg["n_layer"],
        "expand": ssm.get("expand", 2), "conv_kernel": ssm.get("d_conv", 4),
        "dtype": cfg.get("dtype", "bfloat16"),
    }  # fmt: skip
    if ssm.get("layer") == "Mamba2":
        head_dim = ssm.get("headdim", 64)
        hf |= {"architectures": ["Mamba2ForCausalLM"], "state_size": ssm.get("d_state", 128),
               "head_dim": head_dim, "num_heads": hf["expand"] * cfg["d_model"] // head_dim,
               "n_groups": ssm.get("ngroups", 1)}  # fmt: skip
    else:
        hf |= {"architectures": ["MambaForCausalLM"], "state_size": ssm.get("d_state", 16)}
    return hf


def parse_hf_config(cfg: Config) -> ParsedConfig:
    """Shapes and dtypes of any supported config dict (see ``PARSERS``)."""
    if "d_model" in cfg and "n_layer" in cfg:
        cfg = _from_mamba_ssm(cfg)
    arch = (cfg.get("architectures") or [None])[0]
    arch = arch if arch in PARSERS else MODEL_TYPES.get(str(cfg.get("model_type")), arch)
    if arch in PARSERS:
        return PARSERS[arch](cfg)
    if "num_attention_heads" in cfg and "num_hidden_layers" in cfg:
        return parse_transformer(cfg)
    raise ValueError(f"unsupported config (architectures={cfg.get('architectures')})")

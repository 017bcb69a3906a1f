"""Architecture-neutral description of a hybrid model, parsed from an HF `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Sublayer kinds. A sublayer is `h = h + residual_multiplier * mixer(norm(h))`.
SSM_KINDS = ("mamba2", "mamba1")
KINDS = (*SSM_KINDS, "attention", "mlp", "moe")


@dataclass(frozen=True)
class SublayerSpec:
    """One pre-norm residual sublayer: its kind and the constructor arguments of its mixer."""

    kind: str
    args: tuple[tuple[str, Any], ...]

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)


@dataclass(frozen=True)
class MemorySpec:
    """Per-slot tensor shapes a HybridMemory must hold for a model."""

    num_attention_layers: int
    kv_shape: tuple[int, ...]  # (kv_heads, head_dim)
    num_ssm_layers: int
    conv_shape: tuple[int, ...]  # (K-1, conv_dim)
    ssm_shape: tuple[int, ...]  # (heads, head_dim, d_state) or (d_inner, d_state)


@dataclass(frozen=True)
class HybridConfig:
    """Everything our runtime needs to build and run a model; `hf` keeps the raw config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    norm_eps: float
    sublayers: tuple[SublayerSpec, ...]
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    hf: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    @property
    def memory_spec(self) -> MemorySpec:
        """Shapes of one KV slot (per attention layer) and one state slot (per SSM layer)."""
        attn = [s.kwargs for s in self.sublayers if s.kind == "attention"]
        ssm = [s for s in self.sublayers if s.kind in SSM_KINDS]
        kv = {(a["num_kv_heads"], a["head_dim"]) for a in attn}
        shapes = {_ssm_shapes(s) for s in ssm}
        if len(kv) > 1 or len(shapes) > 1:
            raise ValueError("layers of one kind must share state shapes")
        conv, state = shapes.pop() if shapes else ((0, 0), (0,))
        return MemorySpec(len(attn), kv.pop() if kv else (0, 0), len(ssm), conv, state)


def _ssm_shapes(s: SublayerSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    a = s.kwargs
    if s.kind == "mamba2":
        inner = a["num_heads"] * a["head_dim"]
        conv_dim = inner + 2 * a["n_groups"] * a["d_state"]
        return (a["d_conv"] - 1, conv_dim), (a["num_heads"], a["head_dim"], a["d_state"])
    return (a["d_conv"] - 1, a["d_inner"]), (a["d_inner"], a["d_state"])


def spec(kind: str, **kwargs: Any) -> SublayerSpec:
    """Shorthand constructor: `spec("mlp", hidden=..., ...)`."""
    if kind not in KINDS:
        raise ValueError(f"unknown sublayer kind {kind!r}")
    return SublayerSpec(kind, tuple(sorted(kwargs.items())))


def hf_float(v: Any) -> float:
    """Floats as HF writes them, including `{"__float__": "Infinity"}`."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def rope_theta(cfg: dict[str, Any], default: float = 10000.0) -> float:
    rp = cfg.get("rope_parameters") or {}
    return float(rp.get("rope_theta", cfg.get("rope_theta", default)))

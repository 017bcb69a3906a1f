"""Architecture-neutral description of a hybrid model, parsed from an HF `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from marconi.cache.spec import ModelCacheSpec

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
    #: the cache layer specs, from the same config parser as the cost model's
    cache_spec: ModelCacheSpec = field(default=ModelCacheSpec((), ()), repr=False)


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

"""Layer shapes of a hybrid LLM, as the cost model consumes them (frozen dataclasses), and the
bytes per element of the cache dtypes. ``marconi.cache.hf_config`` fills them from a config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` ("bf16", "torch.float16", "float32", ...)."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class AttentionShape:
    """``count`` identical attention mixers (GQA aware); KV per token: 2*kv_heads*head_dim."""

    count: int
    in_dim: int
    out_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MLPShape:
    """``count`` identical MLPs ``in_dim -> intermediate -> in_dim``; gated: 3 matrices."""

    count: int
    in_dim: int
    intermediate: int
    gated: bool


@dataclass(frozen=True)
class MoEShape:
    """``count`` identical MoE blocks: router, ``top_k`` of ``num_experts`` expert MLPs, and an
    optional always-on shared expert (``shared_intermediate`` 0 = none). ``latent_dim`` > 0: the
    experts run in a projected latent space (Nemotron-3 ``moe_latent_size``)."""

    count: int
    in_dim: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    gated: bool
    shared_intermediate: int = 0
    shared_gated: bool = True
    latent_dim: int = 0


@dataclass(frozen=True)
class SSMShape:
    """``count`` identical Mamba mixers.

    Mamba-1 (``kind="mamba1"``): conv state [d_inner, d_conv], ssm state [d_inner, d_state].
    Mamba-2: conv state [d_inner + 2*n_groups*d_state, d_conv], ssm state
    [num_heads, head_dim, d_state] with d_inner = num_heads*head_dim.
    """

    count: int
    kind: Literal["mamba1", "mamba2"]
    in_dim: int
    d_inner: int
    d_state: int
    d_conv: int
    num_heads: int = 0
    head_dim: int = 0
    n_groups: int = 1
    dt_rank: int = 0

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv (and of the conv state)."""
        if self.kind == "mamba1":
            return self.d_inner
        return self.d_inner + 2 * self.n_groups * self.d_state

    @property
    def conv_state_elems(self) -> int:
        return self.conv_dim * self.d_conv

    @property
    def ssm_state_elems(self) -> int:
        return self.d_inner * self.d_state


@dataclass(frozen=True)
class LinearShape:
    """``count`` plain ``in_dim -> out_dim`` projections (the Zamba2 hybrid linear)."""

    count: int
    in_dim: int
    out_dim: int


@dataclass(frozen=True)
class ParsedConfig:
    """What a parser extracts: shapes grouped by identity, plus the cache dtypes."""

    hidden_size: int
    attention: tuple[AttentionShape, ...]
    mlp: tuple[MLPShape, ...]
    moe: tuple[MoEShape, ...]
    ssm: tuple[SSMShape, ...]
    linear: tuple[LinearShape, ...]
    dtype: str
    ssm_state_dtype: str

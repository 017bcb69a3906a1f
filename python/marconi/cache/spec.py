"""Layer specs: what one cache slot of each layer kind holds, and how many bytes it takes.

vLLM v1's ``KVCacheSpec`` idea: one frozen spec per layer kind with its own byte count, built
once per architecture from the HF config (``cache_spec_from_hf``: the shapes of
``marconi.cache.hf_config``, the only config parser) and read by everything that counts bytes:
``HybridMemory`` allocates its tensors from it, ``CostModel`` takes its byte fields from it, the
simulator's presets are cost models of it, and the SGLang backend checks SGLang's pools against
it. Dtypes are always explicit (the served ones, ``CacheDtypes``).

Conv state columns: our runtime, SGLang and vLLM keep the last ``d_conv - 1`` inputs of the
causal conv (``conv_columns=None``, the default everywhere); transformers' HF cache keeps
``d_conv`` (pass ``conv_columns=d_conv`` to count that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from marconi.cache.hf_config import parse_hf_config
from marconi.cache.shapes import SSMShape, dtype_bytes

if TYPE_CHECKING:
    from marconi.cache.shapes import ParsedConfig


@dataclass(frozen=True)
class CacheDtypes:
    """The dtypes a runtime stores the cache in: KV and conv state in ``kv``, SSM state in
    ``ssm`` (fp32 in our runtime, transformers' and SGLang's default)."""

    kv: str
    ssm: str = "float32"


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer: a KV slot holds one token's K and V, ``[num_kv_heads, head_dim]``
    each."""

    num_kv_heads: int
    head_dim: int

    @property
    def slot_shape(self) -> tuple[int, int]:
        return (self.num_kv_heads, self.head_dim)

    def bytes_per_slot(self, dtype: str) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes(dtype)


@dataclass(frozen=True)
class MambaSpec:
    """One Mamba layer: a state slot holds its conv state ``[conv_columns, conv_dim]`` and its
    SSM state ``state_shape`` (Mamba-2: heads x head_dim x d_state; Mamba-1: d_inner x d_state).
    """

    conv_dim: int
    d_conv: int
    state_shape: tuple[int, ...]

    def conv_shape(self, conv_columns: int | None = None) -> tuple[int, int]:
        return (self.d_conv - 1 if conv_columns is None else conv_columns, self.conv_dim)

    def conv_bytes(self, dtype: str, conv_columns: int | None = None) -> int:
        rows, cols = self.conv_shape(conv_columns)
        return rows * cols * dtype_bytes(dtype)

    def ssm_bytes(self, state_dtype: str) -> int:
        n = 1
        for d in self.state_shape:
            n *= d
        return n * dtype_bytes(state_dtype)

    def bytes_per_slot(
        self, dtype: str, conv_columns: int | None = None, state_dtype: str | None = None
    ) -> int:
        """Conv state in ``dtype`` plus SSM state in ``state_dtype`` (default ``dtype``)."""
        return self.conv_bytes(dtype, conv_columns) + self.ssm_bytes(state_dtype or dtype)

    @classmethod
    def of(cls, s: SSMShape) -> MambaSpec:
        if s.kind == "mamba1":
            return cls(s.conv_dim, s.d_conv, (s.d_inner, s.d_state))
        return cls(s.conv_dim, s.d_conv, (s.num_heads, s.head_dim, s.d_state))


@dataclass(frozen=True)
class ModelCacheSpec:
    """Every layer's spec: one per attention layer, one per Mamba layer (grouped by shape)."""

    attention: tuple[AttentionSpec, ...]
    mamba: tuple[MambaSpec, ...]

    def kv_bytes_per_token(self, dtypes: CacheDtypes) -> int:
        """Bytes one token's KV takes over all attention layers (a KV slot)."""
        return sum(a.bytes_per_slot(dtypes.kv) for a in self.attention)

    def conv_state_bytes(self, dtypes: CacheDtypes, conv_columns: int | None = None) -> int:
        return sum(m.conv_bytes(dtypes.kv, conv_columns) for m in self.mamba)

    def ssm_state_bytes(self, dtypes: CacheDtypes) -> int:
        return sum(m.ssm_bytes(dtypes.ssm) for m in self.mamba)

    def state_bytes(self, dtypes: CacheDtypes, conv_columns: int | None = None) -> int:
        """Bytes one SSM checkpoint takes over all Mamba layers (a state slot)."""
        return sum(m.bytes_per_slot(dtypes.kv, conv_columns, dtypes.ssm) for m in self.mamba)

    def uniform(self) -> tuple[AttentionSpec | None, MambaSpec | None]:
        """The one attention and one Mamba spec every layer of a kind shares (our runtime stores
        each kind in one tensor); raises ValueError if layers of a kind differ."""
        return _only(self.attention, "attention"), _only(self.mamba, "Mamba")

    @classmethod
    def of(cls, parsed: ParsedConfig) -> ModelCacheSpec:
        attn = tuple(
            AttentionSpec(a.num_kv_heads, a.head_dim)
            for a in parsed.attention
            for _ in range(a.count)
        )
        mamba = tuple(MambaSpec.of(s) for s in parsed.ssm for _ in range(s.count))
        return cls(attn, mamba)


def _only(specs: tuple[Any, ...], kind: str) -> Any:
    distinct = set(specs)
    if len(distinct) > 1:
        raise ValueError(f"{kind} layers of one model must share one slot shape: {distinct}")
    return next(iter(distinct), None)


def cache_spec_from_hf(config: dict[str, Any]) -> ModelCacheSpec:
    """The layer specs of an HF ``config.json`` dict (see ``marconi.cache.hf_config``)."""
    return ModelCacheSpec.of(parse_hf_config(config))

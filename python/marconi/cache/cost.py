"""Cost model of a hybrid (attention + SSM) LLM: prefill FLOPs and cache bytes.

Marconi's eviction ranks a cache node by FLOPs a hit saves per byte it holds, so the cache needs
(a) the KV bytes one token adds over all attention layers, (b) the bytes of one SSM checkpoint
(conv + SSM state of every SSM layer) and (c) the FLOPs to prefill tokens [start, end) given
that [0, start) is cached. ``load_cost_model("jamba-1.5-mini")`` builds one from a preset in
``presets/`` (HF-style ``config.json`` files with shape fields only) or from any ``config.json``.

Per-token FLOPs, one layer, 2 FLOPs per multiply-add, D_in/D_out the block's input/output width:

- attention: 2*D_in*H*hd (q) + 4*D_in*KVH*hd (k, v) + 2*H*hd*D_out (o), plus the quadratic term
  ``4*H*hd*(end^2 - start^2)`` over [start, end) (the paper's 4L^2D: QK^T and AV over the full
  L x L matrix; ``causal_attention=True`` counts only the lower triangle: each token i attends to
  i+1 keys, ``2*H*hd*(end*(end+1) - start*(start+1))``). MHA with H*hd = D: 8LD^2 + 4L^2D.
- MLP: 2*D*I*(3 if gated else 2). Non-gated with I = 4D: the paper's 16LD^2.
- MoE: router 2*D*E + top_k expert MLPs + shared expert MLP (+ 4*D*latent latent projections).
- Mamba-1: in_proj 4*D*d_in, conv 2*d_conv*d_in, x_proj 2*d_in*(R + 2N), dt_proj 2*R*d_in,
  scan 4*d_in*N (state update h = Ah + Bx and readout C.h: 2 FLOPs each per state element),
  elementwise 5*d_in (D skip, z gate, dt softplus), out_proj 2*d_in*D. With d_in = 2D this is
  the paper's 12LD^2 + 16LDN + 10LD plus the conv and dt-rank terms.
- Mamba-2: in_proj 2*D*(2*d_in + 2*G*N + H), conv 2*d_conv*(d_in + 2*G*N), scan 4*d_in*N
  (recurrent-equivalent count of the chunked SSD scan), elementwise 5*d_in, out_proj 2*d_in*D.

Ignored (O(L*D), small): norms, residual adds, rotary embeddings, LoRA adapters; the embedding
lookup and the LM head (run on the last token only, so never saved by a hit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from marconi.cache.hf_config import parse_hf_config
from marconi.cache.shapes import (
    AttentionShape,
    LinearShape,
    MLPShape,
    MoEShape,
    ParsedConfig,
    SSMShape,
)
from marconi.cache.spec import CacheDtypes, ModelCacheSpec

PRESET_DIR = Path(__file__).with_name("presets")

ArrayLike = int | float | np.ndarray


@dataclass(frozen=True)
class LayerCounts:
    """Number of blocks of each kind (a Falcon-H1 layer counts as 1 attention + 1 ssm + 1 mlp)."""

    attention: int
    ssm: int
    mlp: int
    moe: int


def _mlp_flops(in_dim: int, intermediate: int, gated: bool) -> int:
    return 2 * in_dim * intermediate * (3 if gated else 2)


def attention_token_flops(a: AttentionShape) -> int:
    """Linear (projection) FLOPs per token of one attention layer; see the module docstring."""
    q = a.num_heads * a.head_dim
    return 2 * a.in_dim * q + 4 * a.in_dim * a.num_kv_heads * a.head_dim + 2 * q * a.out_dim


def mlp_token_flops(m: MLPShape) -> int:
    """FLOPs per token of one MLP."""
    return _mlp_flops(m.in_dim, m.intermediate, m.gated)


def moe_token_flops(m: MoEShape) -> int:
    """FLOPs per token of one MoE block: router + active experts + shared expert."""
    width = m.latent_dim or m.in_dim
    flops = 2 * m.in_dim * m.num_experts + m.top_k * _mlp_flops(
        width, m.expert_intermediate, m.gated
    )
    if m.latent_dim:
        flops += 4 * m.in_dim * m.latent_dim
    if m.shared_intermediate:
        flops += _mlp_flops(m.in_dim, m.shared_intermediate, m.shared_gated)
    return flops


def ssm_token_flops(s: SSMShape) -> int:
    """FLOPs per token of one Mamba-1 / Mamba-2 mixer; see the module docstring."""
    d, di, n = s.in_dim, s.d_inner, s.d_state
    common = 2 * s.d_conv * s.conv_dim + 4 * di * n + 5 * di + 2 * di * d
    if s.kind == "mamba1":
        return common + 4 * d * di + 2 * di * (s.dt_rank + 2 * n) + 2 * s.dt_rank * di
    return common + 2 * d * (2 * di + 2 * s.n_groups * n + s.num_heads)


@dataclass(frozen=True)
class CostModel:
    """FLOPs and cache bytes of one model; build with ``load_cost_model`` or ``from_parsed``.

    Byte fields come from the layer specs (``marconi.cache.spec``, ``spec``): the slot sizes a
    runtime allocates. ``kv_bytes_per_token`` = sum over attention layers of
    2*num_kv_heads*head_dim*dtype bytes; ``state_bytes`` = ``conv_state_bytes`` +
    ``ssm_state_bytes``, one SSM checkpoint over all SSM layers (conv state
    [d_conv - 1, conv_dim] in the model dtype, as our runtime, SGLang and vLLM keep it, or
    ``conv_columns`` columns; SSM state in ``ssm_state_dtype``).
    """

    name: str
    hidden_size: int
    layers: LayerCounts
    kv_bytes_per_token: int
    state_bytes: int
    conv_state_bytes: int = 0
    ssm_state_bytes: int = 0
    dtype: str = "bfloat16"
    ssm_state_dtype: str = "float32"
    attention: tuple[AttentionShape, ...] = ()
    mlp: tuple[MLPShape, ...] = ()
    moe: tuple[MoEShape, ...] = ()
    ssm: tuple[SSMShape, ...] = ()
    linear: tuple[LinearShape, ...] = ()
    causal_attention: bool = field(default=False)
    spec: ModelCacheSpec = field(default=ModelCacheSpec((), ()), repr=False)

    @classmethod
    def from_parsed(
        cls,
        name: str,
        parsed: ParsedConfig,
        dtype: str | None = None,
        ssm_state_dtype: str | None = None,
        causal_attention: bool = False,
        conv_columns: int | None = None,
    ) -> CostModel:
        """Derive byte sizes from the layer specs of parsed shapes. ``dtype`` overrides every
        cache tensor's dtype (KV, conv and SSM state); ``ssm_state_dtype`` then overrides the
        SSM state alone. ``conv_columns``: conv-state columns (default d_conv - 1; transformers
        keeps d_conv)."""
        model_dtype = dtype or parsed.dtype
        state_dtype = ssm_state_dtype or dtype or parsed.ssm_state_dtype
        spec = ModelCacheSpec.of(parsed)
        dtypes = CacheDtypes(model_dtype, state_dtype)
        kv = spec.kv_bytes_per_token(dtypes)
        conv = spec.conv_state_bytes(dtypes, conv_columns)
        ssm = spec.ssm_state_bytes(dtypes)
        counts = LayerCounts(
            attention=sum(a.count for a in parsed.attention),
            ssm=sum(s.count for s in parsed.ssm),
            mlp=sum(m.count for m in parsed.mlp),
            moe=sum(m.count for m in parsed.moe),
        )
        return cls(
            name=name,
            hidden_size=parsed.hidden_size,
            layers=counts,
            kv_bytes_per_token=kv,
            state_bytes=conv + ssm,
            conv_state_bytes=conv,
            ssm_state_bytes=ssm,
            dtype=model_dtype.removeprefix("torch."),
            ssm_state_dtype=state_dtype.removeprefix("torch."),
            attention=parsed.attention,
            mlp=parsed.mlp,
            moe=parsed.moe,
            ssm=parsed.ssm,
            linear=parsed.linear,
            causal_attention=causal_attention,
            spec=spec,
        )

    @property
    def has_attention(self) -> bool:
        """True when tokens add KV (some attention layer)."""
        return self.layers.attention > 0

    @property
    def has_ssm(self) -> bool:
        """True when a prefix is reusable only where an SSM checkpoint was saved."""
        return self.layers.ssm > 0

    @cached_property
    def flops_per_token(self) -> int:
        """FLOPs per prefilled token excluding the attention score/AV (quadratic) term."""
        return (
            sum(a.count * attention_token_flops(a) for a in self.attention)
            + sum(m.count * mlp_token_flops(m) for m in self.mlp)
            + sum(m.count * moe_token_flops(m) for m in self.moe)
            + sum(s.count * ssm_token_flops(s) for s in self.ssm)
            + sum(x.count * 2 * x.in_dim * x.out_dim for x in self.linear)
        )

    @cached_property
    def attention_width(self) -> int:
        """Sum over attention layers of num_heads*head_dim (the D of the 4L^2D term)."""
        return sum(a.count * a.num_heads * a.head_dim for a in self.attention)

    def prefill_flops(self, end: ArrayLike, start: ArrayLike = 0) -> float | np.ndarray:
        """FLOPs to prefill tokens [start, end) when the KV/state of [0, start) is cached.

        ``flops_per_token * (end - start)`` + the attention term ``4*W*(end^2 - start^2)``
        (``2*W*(end*(end+1) - start*(start+1))`` if ``causal_attention``), W = ``attention_width``.
        Additive: ``prefill_flops(e) == prefill_flops(s) + prefill_flops(e, s)``. ``end`` and
        ``start`` may be numpy arrays (broadcast); scalars give a float.
        """
        if isinstance(end, int | float) and isinstance(start, int | float):  # the hot path
            if start < 0 or end < start:
                raise ValueError("need 0 <= start <= end")
            w = float(self.attention_width)
            if self.causal_attention:
                q = 2.0 * w * (end * (end + 1.0) - start * (start + 1.0))
            else:
                q = 4.0 * w * (float(end) * end - float(start) * start)
            return float(self.flops_per_token) * (end - start) + q
        e = np.asarray(end, dtype=np.float64)
        s = np.asarray(start, dtype=np.float64)
        if np.any(s < 0) or np.any(e < s):
            raise ValueError("need 0 <= start <= end")
        if self.causal_attention:
            quad = 2.0 * self.attention_width * (e * (e + 1) - s * (s + 1))
        else:
            quad = 4.0 * self.attention_width * (e * e - s * s)
        out = float(self.flops_per_token) * (e - s) + quad
        return float(out) if out.ndim == 0 else out

    def cache_bytes(self, num_tokens: ArrayLike, num_states: ArrayLike = 1) -> float | np.ndarray:
        """Bytes held by the KV of ``num_tokens`` tokens plus ``num_states`` SSM checkpoints."""
        out = np.asarray(num_tokens, np.float64) * self.kv_bytes_per_token + np.asarray(
            num_states, np.float64
        ) * float(self.state_bytes)
        return float(out) if out.ndim == 0 else out

    def flops_saved_per_byte(
        self, end: ArrayLike, start: ArrayLike = 0, with_state: bool = True
    ) -> float | np.ndarray:
        """Marconi's FLOP efficiency of a node holding the KV of tokens [start, end) (and, if
        ``with_state``, the SSM checkpoint at ``end``): prefill_flops(end, start) / bytes held.
        0 where the node holds no bytes."""
        flops = np.asarray(self.prefill_flops(end, start))
        held = np.asarray(self.cache_bytes(np.asarray(end) - np.asarray(start), int(with_state)))
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(held > 0, flops / np.where(held > 0, held, 1.0), 0.0)
        return float(out) if out.ndim == 0 else out

    def describe(self) -> str:
        """One line for logs."""
        c = self.layers
        return (
            f"{self.name}: D={self.hidden_size} attn={c.attention} ssm={c.ssm} mlp={c.mlp} "
            f"moe={c.moe} kv={self.kv_bytes_per_token} B/token state={self.state_bytes} B "
            f"({self.dtype}, ssm state {self.ssm_state_dtype}) "
            f"{self.flops_per_token / 1e9:.2f} GFLOP/token"
        )


def list_presets() -> list[str]:
    """Names of the shipped presets (``presets/<name>.json``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def cost_model_from_hf_config(
    config: dict[str, Any],
    name: str = "custom",
    dtype: str | None = None,
    *,
    ssm_state_dtype: str | None = None,
    causal_attention: bool = False,
    conv_columns: int | None = None,
) -> CostModel:
    """Cost model of an HF ``config.json`` dict (Jamba, Nemotron-H, Granite-4.0-hybrid, Bamba,
    Falcon-H1, Zamba2, Mamba, Mamba2, Llama-style). Dtypes come from ``dtype``/``torch_dtype``
    (SSM state: ``mamba_ssm_cache_dtype`` or fp32, as transformers caches it) unless overridden
    (a runtime passes its served dtypes); see ``CostModel.from_parsed``. Raises ValueError for
    unsupported configs."""
    parsed = parse_hf_config(config)
    return CostModel.from_parsed(
        name, parsed, dtype, ssm_state_dtype, causal_attention, conv_columns
    )


def load_cost_model(
    name_or_path: str,
    dtype: str | None = None,
    *,
    ssm_state_dtype: str | None = None,
    causal_attention: bool = False,
    conv_columns: int | None = None,
) -> CostModel:
    """Cost model of a preset name (see ``list_presets()``), or of a path to an HF
    ``config.json`` or to a folder holding one. Unknown names raise ValueError."""
    path = Path(name_or_path)
    if name_or_path in list_presets():
        path, name = PRESET_DIR / f"{name_or_path}.json", name_or_path
    elif path.is_dir() and (path / "config.json").is_file():
        path, name = path / "config.json", path.name
    elif path.is_file():
        name = path.parent.name if path.name == "config.json" else path.stem
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: not a preset ({', '.join(list_presets())}) "
            "nor a config.json file or folder"
        )
    config = json.loads(path.read_text())
    return cost_model_from_hf_config(
        config,
        name,
        dtype,
        ssm_state_dtype=ssm_state_dtype,
        causal_attention=causal_attention,
        conv_columns=conv_columns,
    )

"""Attention with GQA and optional (partial) RoPE over a paged KV store.

KV layout per attention layer: k/v [num_kv_slots, kv_heads, head_dim]; a token's K/V live in the
slot the batch assigns to it. Each forward first writes the new tokens' K/V into their slots and
then attends over the request's full slot list (cached prefix + new tokens), causally.

Decode parts (one new token per request) of fp32 CPU batches read the pool in place through the
C kernel ``csrc/paged_decode_attention.c`` (``MARCONI_DECODE_ATTENTION_KERNEL=0``: never); the
rest gathers each request's K/V and runs torch's SDPA.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from marconi.layers.batch_meta import BatchMeta
from marconi.layers.ckernel import CKernel
from marconi.layers.linear import Linear

DECODE_KERNEL = CKernel(
    "paged_decode_attention.c",
    "paged_decode_attention",
    (*[ctypes.c_void_p] * 7, *[ctypes.c_long] * 5, ctypes.c_float, ctypes.c_long),
    "MARCONI_DECODE_ATTENTION_KERNEL",
    cflags=("-fopenmp",),
)


def decode_attention(
    q: torch.Tensor, meta: BatchMeta, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """Attention output [B, Hq, D] of a decode part (row b: request b's one new token, its K/V
    already in the pool) by the C kernel, or None where it does not apply (not fp32 CPU, not a
    decode part, no kernel): the caller then takes the torch path."""
    if (
        meta.max_new != 1
        or q.dtype != torch.float32
        or k_cache.dtype != torch.float32
        or v_cache.dtype != torch.float32
        or q.device.type != "cpu"
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or meta.kv_index.stride(1) != 1
        or (fn := DECODE_KERNEL.get()) is None
    ):
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    lens, ok = meta.kv_len_tensor, torch.zeros(1, dtype=torch.int64)
    b, hq, d = q.shape
    fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), meta.kv_index.data_ptr(),
        lens.data_ptr(), out.data_ptr(), ok.data_ptr(), b, hq, k_cache.shape[1], d,
        meta.kv_index.stride(0), scale, torch.get_num_threads(),
    )  # fmt: skip
    return out if ok.item() else None


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE on the first `rotary_dim` channels of each head (`partial` rotary)."""

    def __init__(self, head_dim: int, theta: float, partial: float = 1.0) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * partial)
        self.theta = theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """1 / theta^(2i/d), built once per device (no buffer: meta-device loading stays simple)."""
        inv = self._inv_freq.get(device)
        if inv is None:
            exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
            inv = (1.0 / (self.theta**exps)).to(device)
            self._inv_freq[device] = inv
        return inv

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by their absolute `positions` [T]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq(q.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = emb.cos().to(q.dtype).unsqueeze(1)
        sin = emb.sin().to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        xr, xpass = x[..., :rd], x[..., rd:]
        half = rd // 2
        rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
        out = xr * cos + rot * sin
        return torch.cat([out, xpass], dim=-1) if xpass.shape[-1] else out


class PagedAttention(nn.Module):
    """Causal self-attention; parameters q_proj, k_proj, v_proj, o_proj (HF names).

    Guarantees: after `forward`, k_cache/v_cache hold the K/V of every new token at its slot;
    each new token attends to exactly the prefix slots plus the new tokens up to itself.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float | None = None,
        rope: RotaryEmbedding | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        self.rope = rope
        self.q_proj = Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=bias)

    @property
    def kv_shape(self) -> tuple[int, int]:
        return (self.num_kv_heads, self.head_dim)

    def forward(
        self, x: torch.Tensor, meta: BatchMeta, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(q, k, meta.positions)
        k_cache.index_copy_(0, meta.new_kv_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.new_kv_slots, v.to(v_cache.dtype))
        o = meta.per_part(
            lambda rows, m: self._attend(q[rows], k[rows], v[rows], m, k_cache, v_cache)
        )
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: BatchMeta,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attention output [T, Hq, D] of one part of the batch (its K/V already in the cache;
        ``k``/``v`` are its new tokens' own, used when it is one request with no prefix)."""
        gqa = self.num_heads != self.num_kv_heads
        if (o := decode_attention(q, meta, k_cache, v_cache, self.scaling)) is not None:
            return o
        if meta.num_reqs == 1 and meta.prefix_lens[0] == 0:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=self.scaling,
                enable_gqa=gqa,
            )
            return o[0].transpose(0, 1)
        if meta.kv_range is not None and k_cache.dtype == q.dtype:  # one request, slots a..b
            lo, hi = meta.kv_range
            kk = k_cache[lo:hi].transpose(0, 1).unsqueeze(0)  # view [1, Hk, Lk, D]
            vv = v_cache[lo:hi].transpose(0, 1).unsqueeze(0)
        else:
            kk = k_cache[meta.kv_index].to(q.dtype).transpose(1, 2)  # [B, Hk, Lk, D]
            vv = v_cache[meta.kv_index].to(q.dtype).transpose(1, 2)
        if meta.max_new == 1:
            qq = q.unsqueeze(1)
        elif meta.num_reqs == 1:
            qq = q.unsqueeze(0)
        else:
            qq = q.new_zeros(meta.num_reqs, meta.max_new, self.num_heads, self.head_dim)
            qq[meta.tok_req, meta.tok_off] = q
        o = F.scaled_dot_product_attention(
            qq.transpose(1, 2),
            kk,
            vv,
            attn_mask=meta.attn_mask,
            scale=self.scaling,
            enable_gqa=gqa,
        ).transpose(1, 2)
        if meta.max_new == 1:
            return o[:, 0]
        if meta.num_reqs == 1:
            return o[0]
        return o[meta.tok_req, meta.tok_off]

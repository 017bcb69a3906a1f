"""Mamba-1 mixer (Jamba flavour): selective scan from a given state with state capture.

State layout per layer: conv [slots, K-1, d_inner], ssm [slots, d_inner, d_state]. The scan is a
recurrence over time (A is per channel and state, so there is no chunked dual form); discretised
inputs are built in blocks of `block` tokens and each step is one fused multiply-add, so every
intermediate state is available and captures cost nothing extra.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from marconi.layers.batch_meta import BatchMeta
from marconi.layers.conv import causal_conv1d_step, prefill_conv
from marconi.layers.linear import Linear
from marconi.layers.mlp import activation
from marconi.layers.norm import RMSNorm


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    init: torch.Tensor,
    capture_index: tuple[torch.Tensor, torch.Tensor] | None = None,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """y_t = C_t . h_t with h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t (no D skip, no gate), fp32.

    x, dt [R, L, D]; a [D, N]; b, c [R, L, N]; init [R, D, N]. Padded steps must carry dt = 0.
    capture_index = (rows, steps): also return h at those (row, step) pairs (state after step).
    Returns (y [R, L, D], final state [R, D, N], captured [k, D, N] or None).
    """
    r, length, d = x.shape
    state = init.float()
    a = a.float()
    ys = torch.empty(r, length, d, dtype=torch.float32, device=x.device)
    caps = None
    if capture_index is not None:
        caps = torch.empty(capture_index[0].numel(), d, a.shape[1], device=x.device)
    for s0 in range(0, length, block):
        s1 = min(length, s0 + block)
        dtb = dt[:, s0:s1].float().unsqueeze(-1)  # [R, l, D, 1]
        da = torch.exp(dtb * a)
        dbx = (dtb * x[:, s0:s1].float().unsqueeze(-1)) * b[:, s0:s1].float().unsqueeze(2)
        hs = torch.empty_like(da)
        for i in range(s1 - s0):
            torch.addcmul(dbx[:, i], da[:, i], state, out=hs[:, i])
            state = hs[:, i]
        ys[:, s0:s1] = torch.einsum("rldn,rln->rld", hs, c[:, s0:s1].float())
        if capture_index is not None and caps is not None:
            rows, steps = capture_index
            inside = (steps >= s0) & (steps < s1)
            if bool(inside.any()):
                caps[inside] = hs[rows[inside], steps[inside] - s0]
    return ys, state, caps


def selective_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of `selective_scan`'s recurrence (decode), fp32: state [B, D, N], x and dt [B, D],
    a [D, N], b and c [B, N] (shared by all channels) or [B, D, N]. Returns (new state, y [B, D]).
    """
    b, c = (v.float() if v.dim() == 3 else v.float().unsqueeze(1) for v in (b, c))
    dt = dt.float()
    new = torch.addcmul(
        (dt * x.float()).unsqueeze(-1) * b, state, torch.exp(dt.unsqueeze(-1) * a.float())
    )
    return new, (new * c).sum(-1)


class Mamba1Mixer(nn.Module):
    """Mamba-1 mixer with Jamba's RMSNorms on dt, B and C (`inner_norms`).

    Parameters (HF names): in_proj, conv1d.{weight,bias}, x_proj, dt_proj.{weight,bias}, A_log
    [D, N], D, out_proj, and dt_layernorm / b_layernorm / c_layernorm when `inner_norms`.
    State contract as for Mamba2Mixer: resume from the working slot (zeros for a fresh request),
    final state back into it, captured states into the capture slots.
    """

    def __init__(
        self,
        hidden: int,
        d_inner: int,
        d_state: int,
        d_conv: int,
        dt_rank: int,
        eps: float,
        conv_bias: bool = True,
        proj_bias: bool = False,
        inner_norms: bool = True,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.act = activation(act)
        self.in_proj = Linear(hidden, 2 * d_inner, bias=proj_bias)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, bias=conv_bias)
        self.x_proj = Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = Linear(d_inner, hidden, bias=proj_bias)
        self.inner_norms = inner_norms
        if inner_norms:
            self.dt_layernorm = RMSNorm(dt_rank, eps)
            self.b_layernorm = RMSNorm(d_state, eps)
            self.c_layernorm = RMSNorm(d_state, eps)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.d_conv - 1, self.d_inner)

    @property
    def ssm_state_shape(self) -> tuple[int, int]:
        return (self.d_inner, self.d_state)

    def _params(self, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dt after softplus, B, C) from conv outputs xs [..., D]."""
        dt, b, c = self.x_proj(xs).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.inner_norms:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float()
        return F.softplus(dt), b, c

    def forward(
        self, x: torch.Tensor, meta: BatchMeta, conv_cache: torch.Tensor, ssm_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] packed -> [T, hidden]; updates conv_cache / ssm_cache in place.
        The projections run over every row, the conv + scan per part (``BatchMeta.parts``)."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        y = meta.per_part(lambda rows, m: self._mix(xs[rows], m, conv_cache, ssm_cache))
        return self.out_proj((y * F.silu(z.float())).to(x.dtype))

    def _mix(
        self, xs: torch.Tensor, meta: BatchMeta, conv_cache: torch.Tensor, ssm_cache: torch.Tensor
    ) -> torch.Tensor:
        """Conv + selective scan of one part: in_proj's x half [T, D] -> fp32 y [T, D] with the
        D skip, before the gate."""
        slots = meta.state_slots
        a = -torch.exp(self.A_log.float())
        if meta.is_decode:
            out, new_conv = causal_conv1d_step(
                conv_cache[slots].to(xs.dtype), xs, self.conv1d.weight[:, 0], self.conv1d.bias
            )
            conv_cache.index_copy_(0, slots, new_conv.to(conv_cache.dtype))
            xs = self.act(out)
            dt, b, c = self._params(xs)
            state, y = selective_step(ssm_cache[slots].float(), xs.float(), dt, a, b, c)
            ssm_cache.index_copy_(0, slots, state.to(ssm_cache.dtype))
        else:
            init_ssm = meta.resume_states(ssm_cache, torch.float32)
            conv = prefill_conv(xs, meta, conv_cache, self.conv1d.weight[:, 0], self.conv1d.bias)
            xs = self.act(conv)
            has_caps = meta.cap_req.numel() > 0
            dt, b, c = self._params(xs)
            lmax = meta.max_new
            cap_idx = None
            if has_caps:
                cap_idx = (meta.cap_req, (meta.cap_off - 1).clamp(min=0))
            y, final, caps = selective_scan(
                *(_pad(v, meta, lmax) for v in (xs, dt)),  # padding: dt = 0 keeps the state
                a,
                *(_pad(v, meta, lmax) for v in (b, c)),
                init_ssm,
                cap_idx,
            )
            ssm_cache.index_copy_(0, slots, final.to(ssm_cache.dtype))
            if caps is not None:
                at_start = meta.cap_off == 0
                caps[at_start] = init_ssm[meta.cap_req[at_start]]
                ssm_cache.index_copy_(0, meta.cap_slot, caps.to(ssm_cache.dtype))
            y = y[meta.tok_req, meta.tok_off]
        return y + xs.float() * self.D.float()


def _pad(v: torch.Tensor, meta: BatchMeta, lmax: int) -> torch.Tensor:
    out = v.new_zeros(meta.num_reqs, lmax, v.shape[-1])
    out[meta.tok_req, meta.tok_off] = v
    return out

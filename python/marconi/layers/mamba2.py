"""Mamba-2 mixer: chunked SSD scan over variable-length packed batches with in-pass state capture.

State layout per SSM layer: conv [slots, K-1, conv_dim], ssm [slots, heads, head_dim, d_state].
The scan runs over the segments of `BatchMeta.segment_plan(chunk_size)`; a capture position is
always a segment end, so its state falls out of the inter-segment recurrence of the same pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from marconi.layers.batch_meta import BatchMeta, SegmentPlan
from marconi.layers.conv import causal_conv1d, causal_conv1d_step
from marconi.layers.mlp import activation
from marconi.layers.norm import gated_rms_norm


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L] with out[i, j] = sum(x[j+1 : i+1]) for i >= j, -inf above."""
    n = x.shape[-1]
    xe = x.unsqueeze(-1).expand(*x.shape, n)  # [..., k, j] = x[k]
    strict = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=-1)
    out = torch.cumsum(xe.masked_fill(~strict, 0.0), dim=-2)
    lower = torch.tril(torch.ones(n, n, dtype=torch.bool, device=x.device))
    return out.masked_fill(~lower, float("-inf"))


def _segments(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather packed rows x [T, ...] into index's shape (index value T = zero padding)."""
    pad = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return pad[index]


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    plan: SegmentPlan,
    init: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Chunked SSD scan (no D skip) in fp32.

    x [T, H, P], dt [T, H] (already softplus'd), a [H] (negative), b/c [T, G, N], init [R, H, P, N].
    Returns (y [T, H, P], final state [R, H, P, N], [(slots, states [k, H, P, N]) per capture
    segment]). Padding positions carry dt = 0, so they neither decay nor feed the state.
    """
    t, h, p = x.shape
    g, n = b.shape[1], b.shape[2]
    hpg = h // g
    idx = plan.index
    r, s, lc = idx.shape
    xs = _segments(x.float(), idx)  # [R, S, Lc, H, P]
    dts = _segments(dt.float(), idx)  # [R, S, Lc, H]
    bs = _segments(b.float(), idx)  # [R, S, Lc, G, N]
    cs = _segments(c.float(), idx)
    da = (dts * a.float()).permute(0, 1, 3, 2)  # [R, S, H, Lc]
    acs = torch.cumsum(da, dim=-1)
    xdt = xs * dts.unsqueeze(-1)
    # 1. intra-segment outputs (the "attention-like" diagonal blocks)
    cb = torch.einsum("rsign,rsjgn->rsgij", cs, bs)  # [R, S, G, Lc, Lc]
    decay = torch.exp(_segsum(da)).view(r, s, g, hpg, lc, lc)
    m = (cb.unsqueeze(3) * decay).view(r, s, h, lc, lc)
    y = torch.einsum("rshij,rsjhp->rsihp", m, xdt)
    # 2. each segment's own contribution to the state at its end
    w = torch.exp(acs[..., -1:] - acs).permute(0, 1, 3, 2).unsqueeze(-1)  # [R, S, Lc, H, 1]
    xw = (xdt * w).view(r, s, lc, g, hpg, p)
    seg_states = torch.einsum("rsjgn,rsjgkp->rsgkpn", bs, xw).reshape(r, s, h, p, n)
    # 3. inter-segment recurrence: exact states at every segment end (captures come from here)
    seg_decay = torch.exp(acs[..., -1]).view(r, s, h, 1, 1)
    state = init.float()
    starts = torch.empty(r, s, h, p, n, dtype=state.dtype, device=state.device)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k in range(s):
        starts[:, k] = state
        state = state * seg_decay[:, k] + seg_states[:, k]
        cap = plan.capture_at.get(k)
        if cap is not None:
            captured.append((cap[1], state[cap[0]]))
    # 4. contribution of each segment's start state
    y_off = torch.einsum("rsign,rsgkpn->rsigkp", cs, starts.view(r, s, g, hpg, p, n))
    y = y + y_off.reshape(r, s, lc, h, p) * torch.exp(acs).permute(0, 1, 3, 2).unsqueeze(-1)
    out = torch.empty(t + 1, h, p, dtype=y.dtype, device=y.device)
    out[idx.reshape(-1)] = y.reshape(-1, h, p)
    return out[:t], state, captured


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer (grouped B/C, gated RMSNorm) as in Nemotron-H, Bamba, Granite-4.0-hybrid.

    Parameters (HF names): in_proj, conv1d.{weight,bias}, dt_bias, A_log, D, norm.weight, out_proj.
    `forward` reads each request's resume state from its working slot (zeros when the request
    has no cached prefix), writes the state after its last new token back to that slot, and
    writes the state after `prefix + cap_off` tokens into each capture slot.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        d_conv: int,
        chunk_size: int,
        eps: float,
        conv_bias: bool = True,
        proj_bias: bool = False,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.n_groups, self.d_state = (
            num_heads,
            head_dim,
            n_groups,
            d_state,
        )
        self.d_conv, self.chunk_size, self.eps, self.dt_limit = d_conv, chunk_size, eps, dt_limit
        self.inner = num_heads * head_dim
        self.conv_dim = self.inner + 2 * n_groups * d_state
        self.act = activation(act)
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=conv_bias
        )
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, hidden, bias=proj_bias)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.d_conv - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.d_state)

    def _dt(self, dt: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = self.dt_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(min=lo, max=hi)
        return dt

    def _output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = gated_rms_norm(y, z, self.norm.weight, self.inner // self.n_groups, self.eps)
        return self.out_proj(y)

    def forward(
        self, x: torch.Tensor, meta: BatchMeta, conv_cache: torch.Tensor, ssm_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] packed -> [T, hidden]; updates conv_cache / ssm_cache in place."""
        if meta.is_decode:
            return self._decode(x, meta, conv_cache, ssm_cache)
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        slots, km1 = meta.state_slots, self.d_conv - 1
        r = meta.num_reqs
        init_conv = conv_cache[slots].to(x.dtype)
        init_ssm = ssm_cache[slots].float()
        if bool(meta.fresh.any()):
            keep = (~meta.fresh).to(x.dtype)
            init_conv = init_conv * keep.view(r, 1, 1)
            init_ssm = init_ssm * keep.float().view(r, 1, 1, 1)
        xp = x.new_zeros(r, km1 + meta.max_new, self.conv_dim)
        xp[:, :km1] = init_conv
        xp[meta.tok_req, km1 + meta.tok_off] = xbc
        conv = self.act(causal_conv1d(xp, self.conv1d.weight[:, 0], self.conv1d.bias))
        xbc = conv[meta.tok_req, meta.tok_off]
        win = torch.arange(km1, device=x.device)
        lens = torch.tensor(meta.new_lens, device=x.device)
        rows = torch.arange(r, device=x.device).unsqueeze(1)
        conv_cache.index_copy_(0, slots, xp[rows, lens.unsqueeze(1) + win].to(conv_cache.dtype))
        if meta.cap_req.numel():
            cap = xp[meta.cap_req.unsqueeze(1), meta.cap_off.unsqueeze(1) + win]
            conv_cache.index_copy_(0, meta.cap_slot, cap.to(conv_cache.dtype))
        gn = self.n_groups * self.d_state
        xs, b, c = xbc.split([self.inner, gn, gn], dim=-1)
        t = xs.shape[0]
        xs = xs.reshape(t, self.num_heads, self.head_dim)
        plan = meta.segment_plan(self.chunk_size)
        y, final, captured = ssd_scan(
            xs,
            self._dt(dt),
            -torch.exp(self.A_log.float()),
            b.reshape(t, self.n_groups, self.d_state),
            c.reshape(t, self.n_groups, self.d_state),
            plan,
            init_ssm,
        )
        ssm_cache.index_copy_(0, slots, final.to(ssm_cache.dtype))
        if plan.initial_captures is not None:
            req, cslots = plan.initial_captures
            ssm_cache.index_copy_(0, cslots, init_ssm[req].to(ssm_cache.dtype))
        for cslots, st in captured:
            ssm_cache.index_copy_(0, cslots, st.to(ssm_cache.dtype))
        y = y + xs.float() * self.D.float().view(1, -1, 1)
        return self._output(y.reshape(t, self.inner).to(x.dtype), z)

    def _decode(
        self, x: torch.Tensor, meta: BatchMeta, conv_cache: torch.Tensor, ssm_cache: torch.Tensor
    ) -> torch.Tensor:
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        slots = meta.state_slots
        out, new_conv = causal_conv1d_step(
            conv_cache[slots].to(x.dtype), xbc, self.conv1d.weight[:, 0], self.conv1d.bias
        )
        conv_cache.index_copy_(0, slots, new_conv.to(conv_cache.dtype))
        gn = self.n_groups * self.d_state
        xs, b, c = self.act(out).float().split([self.inner, gn, gn], dim=-1)
        bsz, hpg = xs.shape[0], self.num_heads // self.n_groups
        xs = xs.view(bsz, self.num_heads, self.head_dim)
        b = b.view(bsz, self.n_groups, 1, self.d_state).expand(-1, -1, hpg, -1)
        c = c.view(bsz, self.n_groups, 1, self.d_state).expand(-1, -1, hpg, -1)
        b = b.reshape(bsz, self.num_heads, 1, self.d_state)
        c = c.reshape(bsz, self.num_heads, self.d_state, 1)
        dt = self._dt(dt)  # [B, H]
        da = torch.exp(dt * -torch.exp(self.A_log.float())).view(bsz, self.num_heads, 1, 1)
        state = ssm_cache[slots].float() * da + (xs * dt.unsqueeze(-1)).unsqueeze(-1) * b
        ssm_cache.index_copy_(0, slots, state.to(ssm_cache.dtype))
        y = torch.matmul(state, c).squeeze(-1) + xs * self.D.float().view(1, -1, 1)
        return self._output(y.reshape(bsz, self.inner).to(x.dtype), z)

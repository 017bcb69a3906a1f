"""Mamba-2 mixer: chunked SSD scan over variable-length packed batches with in-pass state capture.

State layout per SSM layer: conv [slots, K-1, conv_dim], ssm [slots, heads, head_dim, d_state].
The scan runs over the segments of `BatchMeta.segment_plan(chunk_size)`; a capture position is
always a segment end, so its state falls out of the inter-segment recurrence of the same pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from marconi.layers import ssm_step
from marconi.layers.batch_meta import BatchMeta, SegmentPlan
from marconi.layers.conv import prefill_conv
from marconi.layers.linear import Linear
from marconi.layers.mlp import activation
from marconi.layers.norm import gated_rms_norm


def _segments(x: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """Packed rows x [T, ...] -> padded segments [Q, Lc, ...] (padding rows are zeros).

    Dense plans (one request) are a view when no padding is needed and one tail pad otherwise;
    other plans gather through `plan.index` (index value T selects an appended zero row).
    """
    q, lc = plan.index.shape
    if plan.dense:
        pad = q * lc - x.shape[0]
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return x.view(q, lc, *x.shape[1:]) if x.is_contiguous() else x.reshape(q, lc, *x.shape[1:])
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded[plan.index]


#: exp() of arguments below this is taken as exp(EXP_FLOOR) ~ 1.8e-35 (a coefficient that small
#: changes no fp32 sum): torch's vectorised exp is 10-25x slower on arguments below about -87
#: (results in the denormal range or -inf), which long decays and masked entries produce.
EXP_FLOOR = -80.0


def _exp_nonpos_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in place for x <= 0 (clamped to [EXP_FLOOR, 0] first, see EXP_FLOOR)."""
    return x.clamp_(min=EXP_FLOOR, max=0.0).exp_()


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

    Layout: the segments of all requests form one batch dim `q`; the intra-segment part is
    one batched matmul per step (grouped B/C are never expanded to heads), and the decay matrix
    is `exp(cumsum_i - cumsum_j)` (the form mamba_ssm's kernels use) built in place.
    """
    t, h, p = x.shape
    g, n = b.shape[1], b.shape[2]
    hpg = h // g
    q, lc = plan.index.shape
    f32 = torch.float32
    xs = _segments(x.to(f32), plan)  # [q, Lc, H, P]
    dts = _segments(dt.to(f32), plan)  # [q, Lc, H]
    bs = _segments(b.to(f32), plan)  # [q, Lc, G, N]
    cs = _segments(c.to(f32), plan)
    acs = torch.cumsum((dts * a.to(f32)).transpose(1, 2), dim=-1)  # [q, H, Lc]
    # x * dt, head-major [q, H, Lc, P]
    xdt = torch.empty(q, h, lc, p, dtype=f32, device=x.device)
    torch.mul(xs.permute(0, 2, 1, 3), dts.transpose(1, 2).unsqueeze(-1), out=xdt)
    # 1. intra-segment outputs: (C B^T * decay) @ (x dt), per head, B/C shared per group
    cb = torch.matmul(cs.permute(0, 2, 1, 3), bs.permute(0, 2, 3, 1))  # [q, G, Lc, Lc]
    upper = torch.ones(lc, lc, dtype=torch.bool, device=x.device).triu_(1)
    cb.masked_fill_(upper, 0.0)  # causal: j > i contributes nothing
    decay = acs.unsqueeze(-1) - acs.unsqueeze(-2)  # [q, H, Lc(i), Lc(j)], <= 0 where j <= i
    _exp_nonpos_(decay)
    decay.view(q, g, hpg, lc, lc).mul_(cb.unsqueeze(2))
    y = torch.matmul(decay, xdt)  # [q, H, Lc, P]
    # 2. each segment's own contribution to the state at its end: (x dt w)^T B per group
    w = _exp_nonpos_(acs[..., -1:] - acs)  # [q, H, Lc]
    xdt.mul_(w.unsqueeze(-1))
    seg_states = torch.matmul(
        xdt.view(q, g, hpg, lc, p).transpose(-1, -2).reshape(q, g, hpg * p, lc),
        bs.transpose(1, 2),  # [q, G, Lc, N]
    ).view(q, h, p, n)
    # 3. inter-segment recurrence: exact states at every segment end (captures come from here)
    seg_decay = _exp_nonpos_(acs[..., -1].clone()).view(q, h, 1, 1)
    state = init.to(f32)
    starts = torch.empty(q, h, p, n, dtype=f32, device=x.device)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k, (reqs, rows) in enumerate(plan.steps):
        if isinstance(reqs, slice):  # every request has a k-th segment (always so for k = 0)
            starts[rows] = state
            state = torch.addcmul(seg_states[rows], state, seg_decay[rows])
        else:  # in place: `state` is this function's own tensor since step 0
            starts[rows] = state[reqs]
            state[reqs] = torch.addcmul(seg_states[rows], state[reqs], seg_decay[rows])
        cap = plan.capture_at.get(k)
        if cap is not None:
            captured.append((cap[1], state[cap[0]]))
    # 4. contribution of each segment's start state: C @ start^T, decayed by exp(acs)
    y_off = torch.matmul(
        cs.transpose(1, 2),  # [q, G, Lc, N]
        starts.view(q, g, hpg * p, n).transpose(-1, -2),  # [q, G, N, hpg * P]
    )  # [q, G, Lc, hpg * P]
    y_off = y_off.view(q, g, lc, hpg, p).transpose(2, 3).reshape(q, h, lc, p)
    y.addcmul_(y_off, _exp_nonpos_(acs.clone()).unsqueeze(-1))
    y = y.transpose(1, 2).reshape(q * lc, h, p)  # token-major
    return (y[:t] if plan.dense else y[plan.inverse]), state, captured


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
        self._fusable = act in ("silu", "swish")  # the fused decode kernel's activation
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=conv_bias
        )
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.inner))
        self.out_proj = Linear(self.inner, hidden, bias=proj_bias)

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

    def forward(
        self, x: torch.Tensor, meta: BatchMeta, conv_cache: torch.Tensor, ssm_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] packed -> [T, hidden]; updates conv_cache / ssm_cache in place.

        The projections run over every row at once; the conv + scan run per part of the batch
        (``BatchMeta.parts``): pure decodes by the recurrent step, the rest by the chunked scan.
        """
        proj = self.in_proj(x)
        y = meta.per_part(lambda rows, m: self._part(proj[rows], m, conv_cache, ssm_cache))
        return self.out_proj(y)

    def _part(
        self, proj: torch.Tensor, meta: BatchMeta, conv_cache: torch.Tensor, ssm_cache: torch.Tensor
    ) -> torch.Tensor:
        """One part of the batch: in_proj rows -> the gated-normed y that goes into out_proj.
        Pure decodes take the fused C kernel where it applies (``ssm_step.mamba2_decode_fused``)."""
        if meta.is_decode:
            if self._fusable and ssm_step.fused_applies(proj, conv_cache, ssm_cache):
                prm = self._fused_params()
                return ssm_step.mamba2_decode_fused(
                    proj, conv_cache, ssm_cache, meta.state_slots, prm
                )
            y = self._decode(proj, meta, conv_cache, ssm_cache)
        elif self._fusable and ssm_step.prefill_applies(proj, conv_cache, ssm_cache):
            return ssm_step.mamba2_prefill_fused(
                proj, conv_cache, ssm_cache, meta, self._fused_params()
            )
        else:
            y = self._prefill(proj, meta, conv_cache, ssm_cache)
        z = proj[:, : self.inner]
        return gated_rms_norm(y, z, self.norm.weight, self.inner // self.n_groups, self.eps)

    def _prefill(
        self,
        proj: torch.Tensor,
        meta: BatchMeta,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The chunked-scan path: in_proj rows [T, ...] -> y [T, inner] (before the norm)."""
        _, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        slots = meta.state_slots
        init_ssm = meta.resume_states(ssm_cache, torch.float32)
        conv = prefill_conv(xbc, meta, conv_cache, self.conv1d.weight[:, 0], self.conv1d.bias)
        xbc = self.act(conv)
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
        y = (
            y.addcmul_(xs, self.D.float().view(1, -1, 1))
            if y.dtype == xs.dtype
            else (y + xs.float() * self.D.float().view(1, -1, 1))
        )
        return y.reshape(t, self.inner).to(proj.dtype)

    def _decode(
        self,
        proj: torch.Tensor,
        meta: BatchMeta,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request: in_proj rows [B, ...] -> y [B, inner] (before the norm). With
        a single request and fp32 state pools the conv and SSM states are updated in place
        through views of their slot; otherwise gathered and written back."""
        bsz, g, n = proj.shape[0], self.n_groups, self.d_state
        hpg = self.num_heads // g
        _, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        conv_w, conv_b, a_neg, d_skip, dt_bias = self._decode_params(proj.dtype)
        slot = meta.single_state_slot
        slots = meta.state_slots
        in_place_conv = slot is not None and conv_cache.dtype == proj.dtype
        cst = conv_cache.narrow(0, slot, 1) if in_place_conv else conv_cache[slots].to(proj.dtype)
        full = torch.cat([cst, xbc.unsqueeze(1)], dim=1)  # [B, K, C]
        out = (full * conv_w).sum(1)
        if conv_b is not None:
            out += conv_b
        if in_place_conv:
            cst.copy_(full[:, 1:])
        else:
            conv_cache.index_copy_(0, slots, full[:, 1:].to(conv_cache.dtype))
        xs, b, c = self.act(out).float().split([self.inner, g * n, g * n], dim=-1)
        dt = F.softplus(dt.float() + dt_bias)
        lo, hi = self.dt_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(min=lo, max=hi)
        decay = torch.exp(dt * a_neg)
        if ssm_step.applies(ssm_cache):  # one in-place pass over the states (C kernel)
            y = ssm_step.mamba2_decode_step(ssm_cache, slots, xs, dt, decay, b, c)
            return y.addcmul_(xs, d_skip).to(proj.dtype)
        in_place_ssm = slot is not None and ssm_cache.dtype == torch.float32
        st = ssm_cache.narrow(0, slot, 1) if in_place_ssm else ssm_cache[slots].float()
        st.mul_(decay.view(bsz, self.num_heads, 1, 1))
        xdt = xs.view(bsz, self.num_heads, self.head_dim) * dt.unsqueeze(-1)
        sg = st.view(bsz * g, hpg * self.head_dim, n)
        sg.baddbmm_(xdt.view(bsz * g, hpg * self.head_dim, 1), b.reshape(bsz * g, 1, n))
        if not in_place_ssm:
            ssm_cache.index_copy_(0, slots, st.to(ssm_cache.dtype))
        y = torch.bmm(sg, c.reshape(bsz * g, n, 1)).view(bsz, self.inner)
        y.addcmul_(xs, d_skip)
        return y.to(proj.dtype)

    def _decode_params(
        self, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv weight [K, C], conv bias, -exp(A_log) [H], D per channel [inner], dt_bias),
        derived once per weight version instead of once per decode step."""
        params = (self.conv1d.weight, self.conv1d.bias, self.A_log, self.D, self.dt_bias)
        key = (dtype, *((p.data_ptr(), p._version) for p in params if p is not None))
        cached = self.__dict__.get("_derived")
        if cached is None or cached[0] != key:
            bias = self.conv1d.bias
            derived = (
                self.conv1d.weight[:, 0].t().to(dtype).contiguous(),
                None if bias is None else bias.detach().to(dtype),
                -torch.exp(self.A_log.detach().float()),
                self.D.detach().float().repeat_interleave(self.head_dim),
                self.dt_bias.detach().float(),
            )
            cached = (key, derived)
            self.__dict__["_derived"] = cached
        return cached[1]

    def _fused_params(self) -> ssm_step.FusedParams:
        """``_decode_params`` in the fused kernel's form (fp32), rebuilt with them."""
        derived = self._decode_params(torch.float32)
        cached = self.__dict__.get("_fused")
        norm_w = self.norm.weight
        key = (id(derived), norm_w.data_ptr(), norm_w._version)
        if cached is None or cached[0] != key:
            conv_w, conv_b, a_neg, d_skip, dt_bias = derived
            prm = ssm_step.FusedParams(
                conv_w=conv_w,
                conv_b=None if conv_b is None else conv_b.float().contiguous(),
                dt_bias=dt_bias.contiguous(),
                a_neg=a_neg.contiguous(),
                d_skip=d_skip.contiguous(),
                norm_w=norm_w.detach().float().contiguous(),
                dt_limit=(float(self.dt_limit[0]), float(self.dt_limit[1])),
                n_groups=self.n_groups,
                norm_group=self.inner // self.n_groups,
                eps=float(self.eps),
            )
            cached = (key, prm, derived)  # derived kept alive so its id stays unique
            self.__dict__["_fused"] = cached
        return cached[1]

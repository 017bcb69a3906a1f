"""CPU versions of the Mamba kernels SGLang 0.5.23's mixers call, with SGLang's signatures.

SGLang binds its causal-conv kernels only on CUDA/NPU/XPU and runs its SSD scan and state update
as Triton kernels, so its Mamba layers cannot run on a CPU. These functions take the arguments
SGLang's ``MambaMixer2`` (``layers/attention/mamba/mamba.py``) and ``MambaMixer1``
(``mamba1.py``) pass and compute with marconi's own layers (one implementation of the math):

- ``causal_conv1d_fn`` (varlen prefill with initial states; writes the conv states):
  ``marconi.layers.conv.causal_conv1d``;
- ``causal_conv1d_update`` (decode): ``marconi.layers.conv.causal_conv1d_step``;
- ``mamba_chunk_scan_combined`` (varlen SSD scan, initial and final states):
  ``marconi.layers.mamba2.ssd_scan`` over ``build_segment_plan``;
- ``selective_state_update`` (decode; Mamba-2 heads and Mamba-1's head_dim-1 layout):
  ``marconi.layers.mamba1.selective_step``;
- ``MambaMixer1._selective_scan`` (Mamba-1 prefill of one sequence):
  ``marconi.layers.mamba1.selective_scan`` (blocked discretisation, not a per-token loop).

Layouts are SGLang's: conv states [slots, dim, K-1], SSM states [slots, heads, head_dim, N], conv
inputs channel-first [dim, tokens]. Everything is computed in fp32 and stored in the pools'
dtypes. Speculative decoding and tracked states (``extra_buffer``) are not supported: they raise.
``bind.py`` installs these into SGLang's modules when SGLang runs on a CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from marconi.layers.batch_meta import build_segment_plan
from marconi.layers.conv import causal_conv1d, causal_conv1d_step
from marconi.layers.mamba1 import selective_scan, selective_step
from marconi.layers.mamba2 import ssd_scan

PAD_SLOT_ID = -1  # SGLang's marker for padded batch rows (no state to read or write)


def _activate(x: torch.Tensor, activation: str | bool | None) -> torch.Tensor:
    if activation in (None, False):
        return x
    if activation in ("silu", "swish", True):
        return F.silu(x)
    raise NotImplementedError(f"causal conv activation {activation!r}")


def _rows(
    indices: torch.Tensor | None, n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool slot of each of ``n`` batch rows, mask of the rows that have one: not padding)."""
    idx = torch.arange(n, device=device) if indices is None else indices.long()
    return idx, idx != PAD_SLOT_ID


def _gather(
    pool: torch.Tensor, idx: torch.Tensor, live: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The rows' states from ``pool`` in ``dtype`` (zeros for padded rows)."""
    rows = torch.zeros(idx.shape[0], *pool.shape[1:], dtype=dtype, device=pool.device)
    rows[live] = pool[idx[live]].to(dtype)
    return rows


def _time_step(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    softplus: bool,
    limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """dt in fp32 after the bias, the softplus and the clamp SGLang's kernels apply."""
    dt = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    lo, hi = limit
    return dt.clamp(min=lo, max=hi) if lo > 0.0 or hi != float("inf") else dt


def _seq_bounds(query_start_loc: torch.Tensor) -> list[tuple[int, int]]:
    qsl = query_start_loc.tolist()
    return list(itertools.pairwise(qsl))


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | bool | None = None,
    conv_states: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    cache_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens_cpu: Sequence[int] | None = None,
    **unsupported: object,
) -> torch.Tensor:
    """Prefill conv over packed sequences: x [dim, T] -> [dim, T]; sequence i starts from
    ``conv_states[cache_indices[i]]`` when ``has_initial_state[i]`` (else zeros), and its last
    K-1 inputs are written back there."""
    _reject(unsupported)
    k = weight.shape[-1]
    out = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype, device=x.device)  # [T, dim]
    slots = cache_indices.tolist()
    initial = [False] * len(slots) if has_initial_state is None else has_initial_state.tolist()
    for i, (start, end) in enumerate(_seq_bounds(query_start_loc)):
        slot = slots[i]
        xp = x.new_zeros(1, k - 1 + end - start, x.shape[0])  # [1, K-1+L, dim], channel-last
        if initial[i] and slot != PAD_SLOT_ID:
            xp[0, : k - 1] = conv_states[slot].t()
        xp[0, k - 1 :] = x[:, start:end].t()
        out[start:end] = _activate(causal_conv1d(xp, weight, bias)[0], activation)
        if slot != PAD_SLOT_ID:
            conv_states[slot] = xp[0, end - start :].t().to(conv_states.dtype)
    return out.t()


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | bool | None = None,
    conv_state_indices: torch.Tensor | None = None,
    **unsupported: object,
) -> torch.Tensor:
    """One decode token per row: x [B, dim] -> [B, dim]; updates the rows' conv states."""
    _reject(unsupported)
    if x.dim() != 2:
        raise NotImplementedError("causal_conv1d_update on CPU: one token per request only")
    idx, live = _rows(conv_state_indices, x.shape[0], x.device)
    state = _gather(conv_state, idx, live, x.dtype)
    out, new = causal_conv1d_step(state.transpose(1, 2), x, weight, bias)
    conv_state[idx[live]] = new.transpose(1, 2)[live].to(conv_state.dtype)
    return _activate(out, activation)


def mamba_chunk_scan_combined(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    out: torch.Tensor | None = None,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    return_intermediate_states: bool = False,
    state_dtype: torch.dtype | None = None,
    return_track_states: bool = False,
    track_seq_idx: torch.Tensor | None = None,
    track_end_locs: torch.Tensor | None = None,
    **_layout: object,  # seq_idx / chunk_indices / chunk_offsets: the GPU kernels' packing
) -> tuple[torch.Tensor | None, ...] | torch.Tensor | None:
    """The varlen SSD scan as SGLang calls it from ``MambaMixer2`` (batch 1, ``cu_seqlens``).

    Writes y (with the D skip and the optional z gate) into ``out`` [1, T, H, P]; returns the
    per-sequence final states [n, H, P, N] where SGLang asks for "varlen states" (the only
    states ``no_buffer`` caching needs; chunk-boundary states are not materialised)."""
    if (track_end_locs is not None and track_end_locs.numel() > 0) or return_intermediate_states:
        raise NotImplementedError(
            "tracked / intermediate Mamba states (extra_buffer) are not available on CPU; "
            "use --mamba-radix-cache-strategy no_buffer"
        )
    if cu_seqlens is None or x.shape[0] != 1 or return_final_states:
        raise NotImplementedError("mamba_chunk_scan_combined on CPU: varlen (cu_seqlens) only")
    bounds = _seq_bounds(cu_seqlens)
    xs, bs, cs = x[0].float(), B[0].float(), C[0].float()
    dts = _time_step(dt[0], dt_bias, dt_softplus, dt_limit)
    n = len(bounds)
    h, p, dstate = xs.shape[1], xs.shape[2], bs.shape[-1]
    init = initial_states.float() if initial_states is not None else xs.new_zeros(n, h, p, dstate)
    lens = [e - s for s, e in bounds]
    plan = build_segment_plan([0] * n, lens, chunk_size, x.device)
    y, final, _ = ssd_scan(xs, dts, A.float(), bs, cs, plan, init)
    if D is not None:
        y = y + xs * (D.float() if D.dim() == 2 else D.float()[:, None])
    if z is not None:
        y = y * F.silu(z[0].float())
    if out is None:
        out = torch.empty_like(x)
    out.copy_(y.view_as(out).to(out.dtype))
    states = final.to(state_dtype or C.dtype)
    if return_track_states:
        return None, states, None
    return states if return_varlen_states else None


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **unsupported: object,
) -> torch.Tensor:
    """One decode step of the SSM for each row, in place on ``state`` [slots, H, P, N].

    x, dt, z, out [B, H, P]; A [H, P, N]; B, C [B, G, N] (G groups shared by H/G heads each);
    D, dt_bias [H, P]. Mamba-1 passes heads = d_inner and P = 1 (its full-rank layout)."""
    if unsupported.get("disable_state_update") or unsupported.get("intermediate_states_buffer"):
        raise NotImplementedError("speculative decoding is not supported on CPU")
    _reject({k: v for k, v in unsupported.items() if k != "disable_state_update"})
    bsz, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    idx, live = _rows(state_batch_indices, bsz, x.device)
    dtf = _time_step(dt, dt_bias, dt_softplus)
    per_head = (bsz, h, 1, n)
    bh = B.float().repeat_interleave(h // g, dim=1).view(per_head).expand(bsz, h, p, n)
    ch = C.float().repeat_interleave(h // g, dim=1).view(per_head).expand(bsz, h, p, n)
    st = _gather(state, idx, live, torch.float32)
    new, y = selective_step(
        st.view(bsz, h * p, n),
        x.float().reshape(bsz, h * p),
        dtf.reshape(bsz, h * p),
        A.float().reshape(h * p, n),
        bh.reshape(bsz, h * p, n),
        ch.reshape(bsz, h * p, n),
    )
    y = y.view(bsz, h, p)
    if D is not None:
        y = y + x.float() * D.float().view(-1, p if D.dim() == 2 else 1)
    if z is not None:
        y = y * F.silu(z.float())
    state[idx[live]] = new.view(bsz, h, p, n)[live].to(state.dtype)
    if out is None:
        out = torch.empty_like(x)
    out.copy_(y.to(out.dtype))
    return out


def mamba1_selective_scan(
    *,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``MambaMixer1._selective_scan``: x, dt [T, dim]; A [dim, N]; B, C [T, N]; h0 [dim, N] ->
    (final state [dim, N], y [T, dim]) without the D skip and gate (SGLang adds those)."""
    y, h, _ = selective_scan(x[None], dt[None], A, B[None], C[None], h0[None])
    return h[0], y[0]


def _reject(unsupported: dict[str, object]) -> None:
    given = sorted(k for k, v in unsupported.items() if v is not None and v is not False)
    if given:
        raise NotImplementedError(f"not supported by marconi's CPU Mamba kernels: {given}")

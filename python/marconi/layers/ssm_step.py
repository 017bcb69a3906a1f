"""The Mamba-2 mixer's C kernels: the decode step (``csrc/mamba2_decode_step.c``) and the
prefill (``csrc/mamba2_prefill.c``), both updating the state pools in place.

A decode step of B requests reads and writes each request's SSM state once, in its pool slot.
torch's batched path (``Mamba2Mixer._decode``) gathers the B states, decays and updates the copy,
multiplies by C and scatters it back: five passes over states that dominate a decode step's
memory traffic at B > 1 (``docs/performance_log.md``). Built by ``marconi.layers.ckernel``; without
a compiler, or with ``MARCONI_SSM_STEP_KERNEL=0``, ``available()`` is false and the mixer keeps
its torch path. Takes fp32 CPU tensors only (the caller checks with ``applies``).

``mamba2_decode_fused`` goes further: the whole mixer between ``in_proj`` and ``out_proj`` (conv,
SiLU, dt, the recurrence, D skip, gated RMSNorm) in one call, replacing ~30 torch dispatches per
Mamba layer per decode step, which at batch 1 cost more than the recurrence itself. Same switch.

``mamba2_prefill_fused`` is the same mixer for a packed prefill batch (conv, SiLU, dt, the
recurrence token by token with in-pass captures, D skip, gated RMSNorm), multi-threaded with
OpenMP; it replaces the chunked SSD scan of ``Mamba2Mixer._prefill`` (kept for other dtypes and
activations, and as the reference the tests compare with). Its switch:
``MARCONI_SSM_PREFILL_KERNEL=0``.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from marconi.layers.ckernel import CKernel

if TYPE_CHECKING:
    from marconi.layers.batch_meta import BatchMeta

KERNEL = CKernel(
    "mamba2_decode_step.c",
    "mamba2_decode_step",
    (ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_long] * 5, *[ctypes.c_void_p] * 6),
    "MARCONI_SSM_STEP_KERNEL",
    libs=("-lm",),
    cflags=("-fopenmp",),
)


#: ``mamba2_decode_fused``'s ctypes signature (used where the library is not an extension)
FUSED_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_long,
    *[ctypes.c_void_p] * 3,
    *[ctypes.c_long] * 6,
    *[ctypes.c_void_p] * 4,
    ctypes.c_float,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_long,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_long,
)


@cache
def fused_kernel() -> Any | None:
    """``mamba2_decode_fused`` from the step kernel's own library (one build), or None."""
    return KERNEL.companion("mamba2_decode_fused", FUSED_ARGTYPES)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return KERNEL.get() is not None


class FusedParams(NamedTuple):
    """A mixer's derived decode parameters, all fp32 and contiguous (``Mamba2Mixer``)."""

    conv_w: torch.Tensor  # [K, C]
    conv_b: torch.Tensor | None  # [C]
    dt_bias: torch.Tensor  # [H]
    a_neg: torch.Tensor  # [H], -exp(A_log)
    d_skip: torch.Tensor  # [H * P]
    norm_w: torch.Tensor  # [H * P]
    dt_limit: tuple[float, float]
    n_groups: int  # G of B / C
    norm_group: int  # channels per gated-RMSNorm group
    eps: float

    def kernel_args(self) -> tuple[Any, ...]:
        """The fused kernels' shared argument run, in their order: conv_w, conv_b, dt_bias,
        a_neg, lo, hi, d_skip, norm_w, norm_group, eps (pointers, NULL for no conv bias)."""
        conv_b = None if self.conv_b is None else self.conv_b.data_ptr()
        return (
            self.conv_w.data_ptr(), conv_b, self.dt_bias.data_ptr(), self.a_neg.data_ptr(),
            *self.dt_limit, self.d_skip.data_ptr(), self.norm_w.data_ptr(), self.norm_group,
            self.eps,
        )  # fmt: skip


def fused_applies(proj: torch.Tensor, conv_cache: torch.Tensor, ssm_cache: torch.Tensor) -> bool:
    """The fused kernel serves this step: fp32 contiguous CPU rows and pools, kernel built."""
    return (
        proj.dtype == conv_cache.dtype == torch.float32
        and proj.is_contiguous()
        and conv_cache.is_contiguous()
        and conv_cache.device.type == "cpu"
        and applies(ssm_cache)
        and fused_kernel() is not None
    )


def _check_fused(
    proj: torch.Tensor,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    prm: FusedParams,
    rows: int,
) -> None:
    """Raise ValueError unless ``proj`` [rows, >= H*P + C + H], the pools and ``prm`` fit."""
    _, h, p, n = ssm_cache.shape
    _, km1, c = conv_cache.shape
    inner = h * p
    if c != inner + 2 * prm.n_groups * n or proj.shape[0] != rows or proj.shape[1] < inner + c + h:
        raise ValueError(
            f"proj {tuple(proj.shape)} / conv pool {tuple(conv_cache.shape)} do "
            f"not fit ssm pool {tuple(ssm_cache.shape)} with {prm.n_groups} groups"
        )
    if inner % prm.norm_group or tuple(prm.conv_w.shape) != (km1 + 1, c):
        raise ValueError(f"norm group {prm.norm_group} / conv weight {tuple(prm.conv_w.shape)}")


def mamba2_decode_fused(
    proj: torch.Tensor,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    slots: torch.Tensor,
    prm: FusedParams,
) -> torch.Tensor:
    """One token per request: in_proj rows ``proj`` [B, >= H*P + C + H] (z | xBC | dt) ->
    the gated-normed y [B, H * P] that goes into out_proj; ``conv_cache[slots]`` [B, K-1, C] and
    ``ssm_cache[slots]`` [B, H, P, N] advance one token in place. Slots must be distinct."""
    _, h, p, n = ssm_cache.shape
    _, km1, c = conv_cache.shape
    bsz, inner = slots.numel(), h * p
    _check_fused(proj, conv_cache, ssm_cache, prm, bsz)
    slots = slots.to(torch.long).contiguous()
    out = torch.empty(bsz, inner, dtype=torch.float32)
    work = torch.empty(bsz * (c + h), dtype=torch.float32)
    fn = fused_kernel()
    assert fn is not None, "mamba2_decode_fused called without the kernel (fused_applies)"
    fn(
        proj.data_ptr(), proj.shape[1], conv_cache.data_ptr(), ssm_cache.data_ptr(),
        slots.data_ptr(), bsz, h, p, n, prm.n_groups, km1 + 1, *prm.kernel_args(),
        work.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


#: ``mamba2_prefill_fused``'s ctypes signature (used where the library is not an extension)
PREFILL_ARGTYPES = (
    *(ctypes.c_void_p, ctypes.c_long, *[ctypes.c_void_p] * 6, *[ctypes.c_long] * 6),
    *(*[ctypes.c_void_p] * 4, ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p),
    *(ctypes.c_long, ctypes.c_float, *[ctypes.c_void_p] * 3, ctypes.c_long),
    *(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long),
)

PREFILL = CKernel(
    "mamba2_prefill.c",
    "mamba2_prefill_fused",
    PREFILL_ARGTYPES,
    "MARCONI_SSM_PREFILL_KERNEL",
    libs=("-lm",),
    cflags=("-fopenmp",),
)


def prefill_kernel() -> Any | None:
    """``mamba2_prefill_fused`` (``csrc/mamba2_prefill.c``), built on the first call, or None."""
    return PREFILL.get()


def prefill_applies(proj: torch.Tensor, conv_cache: torch.Tensor, ssm_cache: torch.Tensor) -> bool:
    """``mamba2_prefill_fused`` serves this prefill: as ``fused_applies``, and it is built."""
    return fused_applies(proj, conv_cache, ssm_cache) and prefill_kernel() is not None


def mamba2_prefill_fused(
    proj: torch.Tensor,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    meta: BatchMeta,
    prm: FusedParams,
) -> torch.Tensor:
    """A packed prefill: in_proj rows ``proj`` [T, >= H*P + C + H] of ``meta``'s requests ->
    the gated-normed y [T, H * P]; each request resumes from its working slot (zeros when
    fresh), its conv and SSM states advance in place by its new tokens, and every capture of
    ``meta`` gets the states after its offset. The recurrence is the decode step's, token by
    token, so where a prefill is split does not change its result."""
    _, h, p, n = ssm_cache.shape
    _, km1, c = conv_cache.shape
    t, inner = proj.shape[0], h * p
    _check_fused(proj, conv_cache, ssm_cache, prm, t)
    starts, fresh = meta.row_starts, meta.fresh
    if int(starts[-1]) != t:
        raise ValueError(f"proj has {t} rows, the batch {int(starts[-1])}")
    if fresh.dtype != torch.bool:  # the kernel reads one byte a request
        raise ValueError(f"meta.fresh must be bool, got {fresh.dtype}")
    out = torch.empty(t, inner, dtype=torch.float32)
    work = torch.empty(t * (c + 2 * h) + meta.num_reqs * km1 * c, dtype=torch.float32)
    fn = prefill_kernel()
    assert fn is not None, "mamba2_prefill_fused called without the kernel (prefill_applies)"
    rows = (meta.state_slots, starts, meta.tok_req)
    slots, starts, tok_req = (x.to(torch.long).contiguous() for x in rows)
    cap = [x.to(torch.long).contiguous() for x in (meta.cap_req, meta.cap_off, meta.cap_slot)]
    fn(
        proj.data_ptr(), proj.shape[1], conv_cache.data_ptr(), ssm_cache.data_ptr(),
        slots.data_ptr(), starts.data_ptr(), tok_req.data_ptr(), fresh.contiguous().data_ptr(),
        meta.num_reqs, h, p, n, prm.n_groups, km1 + 1, *prm.kernel_args(),
        *(x.data_ptr() for x in cap), cap[0].numel(), work.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def applies(ssm_cache: torch.Tensor) -> bool:
    """The kernel serves this pool: fp32, contiguous, on the CPU, and the kernel is built."""
    return (
        ssm_cache.device.type == "cpu"
        and ssm_cache.dtype == torch.float32
        and ssm_cache.is_contiguous()
        and available()
    )


def mamba2_decode_step(
    ssm_cache: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    decay: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
) -> torch.Tensor:
    """Update ``ssm_cache[slots]`` [B, H, P, N] in place by one token and return y [B, H * P]
    (no D skip): x [B, H * P], dt [B, H] (after softplus and clamping), decay = exp(dt * A)
    [B, H],
    b / c [B, G * N]. Slots must be distinct (each request's own working slot)."""
    _, h, p, n = ssm_cache.shape
    bsz = slots.numel()
    g = b.shape[-1] // n
    f32 = torch.float32
    x, dt, decay, b, c = (t.to(f32).contiguous() for t in (x, dt, decay, b, c))
    slots = slots.to(torch.long).contiguous()
    want = ((bsz, h * p), (bsz, h), (bsz, h), (bsz, g * n), (bsz, g * n))
    got = tuple(tuple(t.shape) for t in (x, dt, decay, b, c))
    if got != want:
        raise ValueError(f"x, dt, decay, b, c shapes {got} != {want}")
    y = torch.empty(bsz, h * p, dtype=f32)
    fn = KERNEL.get()
    assert fn is not None, "mamba2_decode_step called without the kernel (check applies())"
    ptrs = (t.data_ptr() for t in (x, dt, decay, b, c, y))
    fn(ssm_cache.data_ptr(), slots.data_ptr(), bsz, h, p, n, g, *ptrs)
    return y

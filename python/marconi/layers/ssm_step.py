"""The Mamba-2 decode state update as one in-place C pass (``csrc/mamba2_decode_step.c``).

A decode step of B requests reads and writes each request's SSM state once, in its pool slot.
torch's batched path (``Mamba2Mixer._decode``) gathers the B states, decays and updates the copy,
multiplies by C and scatters it back: five passes over states that dominate a decode step's
memory traffic at B > 1 (``docs/performance.md``). Built by ``marconi.layers.ckernel``; without
a compiler, or with ``MARCONI_SSM_STEP_KERNEL=0``, ``available()`` is false and the mixer keeps
its torch path. Takes fp32 CPU tensors only (the caller checks with ``applies``).
"""

from __future__ import annotations

import ctypes

import torch

from marconi.layers.ckernel import CKernel

KERNEL = CKernel(
    "mamba2_decode_step.c",
    "mamba2_decode_step",
    (ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_long] * 5, *[ctypes.c_void_p] * 6),
    "MARCONI_SSM_STEP_KERNEL",
)


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return KERNEL.get() is not None


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

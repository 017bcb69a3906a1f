"""RMSNorm and the gated, grouped RMSNorm of Mamba-2 mixers (computed in fp32).

Decode steps (at most ``KERNEL_MAX_ROWS`` fp32 CPU rows) take the C kernel ``csrc/rms_norm.c``
(built by ``marconi.layers.ckernel``; ``MARCONI_RMS_NORM_KERNEL=0`` turns it off): torch's
``F.rms_norm`` costs ~50 us a call there in dispatch alone, once or twice per layer per step.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from marconi.layers.ckernel import CKernel

#: most rows the C kernel takes; larger inputs (prefill) keep torch's multi-threaded op
KERNEL_MAX_ROWS = 16

KERNEL = CKernel(
    "rms_norm.c",
    "rms_norm_rows",
    (*[ctypes.c_void_p] * 3, ctypes.c_long, ctypes.c_long, ctypes.c_float),
    "MARCONI_RMS_NORM_KERNEL",
    libs=("-lm",),
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim; statistics in fp32, result in `x.dtype`."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if (
            x.dim() == 2
            and x.shape[0] <= KERNEL_MAX_ROWS
            and x.device.type == "cpu"
            and x.is_contiguous()
            and weight.is_contiguous()
            and (fn := KERNEL.get()) is not None
        ):
            y = torch.empty_like(x)
            fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
            return y
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one op (same math in fp32)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Mamba-2 output norm: `rms_norm(x * silu(gate))` per group of `group_size` channels.

    Gate before norm (`norm_before_gate=False` in mamba_ssm terms), as Nemotron-H, Bamba and
    Granite-4.0-hybrid do.
    """
    xf = x.float() * F.silu(gate.float())
    shape = xf.shape
    xg = xf.view(*shape[:-1], shape[-1] // group_size, group_size)
    if weight.dtype == torch.float32:
        xg = F.rms_norm(xg, (group_size,), None, eps)
        return (xg.view(shape) * weight).to(x.dtype)
    xg = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xg.view(shape)).to(x.dtype)


class RMSNorm(nn.Module):
    """Plain RMSNorm with a learned scale named `weight`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

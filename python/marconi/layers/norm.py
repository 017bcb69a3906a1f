"""RMSNorm and the gated, grouped RMSNorm of Mamba-2 mixers (computed in fp32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim; statistics in fp32, result in `x.dtype`."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
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

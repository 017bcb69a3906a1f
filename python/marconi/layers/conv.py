"""Depthwise causal conv1d in channel-last layout, with conv-state capture and a decode step.

Conv state layout: [..., K-1, C] = the last K-1 inputs (oldest first), i.e. exactly what must be
prepended to the next tokens' inputs. Weight layout: [C, K] (HF `conv1d.weight[:, 0, :]`).
"""

from __future__ import annotations

import torch


def causal_conv1d(
    xp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Conv outputs for `xp` [B, K-1+L, C] (state then L new inputs) -> [B, L, C], no activation.

    The conv state after the first q new inputs is `xp[:, q : q + K - 1]`: callers slice captures
    from the same buffer, no recomputation.
    """
    k = weight.shape[1]
    length = xp.shape[1] - (k - 1)
    w = weight.t().to(xp.dtype)  # [K, C]
    out = xp[:, k - 1 : k - 1 + length] * w[k - 1]
    for i in range(k - 1):
        out.addcmul_(xp[:, i : i + length], w[i])
    if bias is not None:
        out += bias.to(xp.dtype)
    return out


def causal_conv1d_step(
    state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: state [B, K-1, C], x [B, C] -> (out [B, C] pre-activation, new state)."""
    full = torch.cat([state, x.unsqueeze(1)], dim=1)  # [B, K, C]
    out = torch.einsum("bkc,ck->bc", full, weight.to(x.dtype))
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out, full[:, 1:]

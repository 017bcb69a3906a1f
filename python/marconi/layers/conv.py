"""Depthwise causal conv1d in channel-last layout, with conv-state capture and a decode step.

Conv state layout: [..., K-1, C] = the last K-1 inputs (oldest first), i.e. exactly what must be
prepended to the next tokens' inputs. Weight layout: [C, K] (HF `conv1d.weight[:, 0, :]`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from marconi.layers.batch_meta import BatchMeta


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


def prefill_conv(
    x: torch.Tensor,
    meta: BatchMeta,
    conv_cache: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Conv outputs (no activation) [T, C] of a packed prefill's inputs x [T, C].

    Every request's resume state (zeros when it starts fresh) and new rows are laid out as one
    sequence (``BatchMeta.conv_rows``) and convolved once, with no padding to the longest
    request. Writes each request's conv state after its new tokens to its working slot and each
    capture's state to its capture slot.
    """
    km1 = weight.shape[1] - 1
    slots, lay = meta.state_slots, meta.conv_rows(km1)
    head = meta.resume_states(conv_cache, x.dtype)  # [B, K-1, C]
    if meta.num_reqs == 1:  # the layout is the state followed by the new rows
        xp = torch.cat([head[0], x])
    else:
        xp = x.new_empty(x.shape[0] + meta.num_reqs * km1, x.shape[1])
        xp[lay.head] = head.view(-1, x.shape[1])
        xp[lay.tokens] = x
    out = causal_conv1d(xp.unsqueeze(0), weight, bias)[0]
    conv_cache.index_copy_(0, slots, xp[lay.ends].to(conv_cache.dtype))
    if meta.cap_req.numel():
        conv_cache.index_copy_(0, meta.cap_slot, xp[lay.captures].to(conv_cache.dtype))
    return out if meta.num_reqs == 1 else out[lay.outputs]


def causal_conv1d_step(
    state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: state [B, K-1, C], x [B, C] -> (out [B, C] pre-activation, new state)."""
    full = torch.cat([state, x.unsqueeze(1)], dim=1)  # [B, K, C]
    out = torch.einsum("bkc,ck->bc", full, weight.to(x.dtype))
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out, full[:, 1:]

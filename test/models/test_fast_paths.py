"""The runtime's CPU fast paths agree with the plain ones they replace."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from marconi.layers import build_batch_meta
from marconi.layers.linear import SKINNY_ROWS, Linear, packed_linear_enabled
from marconi.models import SequenceInput


def test_packed_linear_matches_f_linear_and_follows_weight_updates() -> None:
    g = torch.Generator().manual_seed(0)
    lin = Linear(48, 40, bias=True)
    x = torch.randn(SKINNY_ROWS[1] + 5, 48, generator=g)  # past the decode kernels
    with torch.no_grad():
        for _ in range(2):  # second round: new weights must invalidate the packed copy
            lin.weight.copy_(torch.randn(40, 48, generator=g))
            lin.bias.copy_(torch.randn(40, generator=g))
            ref = F.linear(x, lin.weight, lin.bias)
            torch.testing.assert_close(lin(x), ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lin(x[:3]), ref[:3], atol=1e-5, rtol=1e-5)
    assert packed_linear_enabled() == (lin._packed is not None)


def test_kv_range_only_for_one_request_with_consecutive_slots() -> None:
    cpu = torch.device("cpu")
    one = build_batch_meta([SequenceInput([1, 2], [7, 8, 9, 10], 0)], cpu)
    assert one.kv_range == (7, 11)
    gap = build_batch_meta([SequenceInput([1, 2], [7, 8, 10, 11], 0)], cpu)
    assert gap.kv_range is None
    two = build_batch_meta([SequenceInput([1], [0, 1], 0), SequenceInput([1], [2, 3], 1)], cpu)
    assert two.kv_range is None


def test_rms_norm_kernel_matches_torch_for_decode_rows() -> None:
    from marconi.layers import norm

    assert norm.KERNEL.get() is not None  # a C compiler is part of the dev/CI setup
    g = torch.Generator().manual_seed(1)
    w = torch.randn(389, generator=g)  # not a multiple of the kernel's 16 lanes
    for rows in (1, 3, norm.KERNEL_MAX_ROWS, norm.KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 389, generator=g) * 3
        torch.testing.assert_close(
            norm.rms_norm(x, w, 1e-5), F.rms_norm(x, (389,), w, 1e-5), atol=1e-6, rtol=1e-5
        )
    x = torch.randn(2, 3, 389, generator=g)  # not 2-D: torch's op
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-5), F.rms_norm(x, (389,), w, 1e-5))

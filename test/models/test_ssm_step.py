"""The Mamba-2 decode-step kernel (``marconi.layers.ssm_step``) against a torch reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from marconi.layers import ssm_step


def reference(pool, slots, x, dt, decay, b, c):
    """The recurrence written out in torch on a copy: (new pool, y)."""
    bsz, (h, p, n), g = slots.numel(), pool.shape[1:], b.shape[-1] // pool.shape[-1]
    bh = b.view(bsz, g, 1, n).repeat_interleave(h // g, dim=1)  # [B, H, 1, N]
    ch = c.view(bsz, g, 1, n).repeat_interleave(h // g, dim=1)
    st = (
        pool[slots] * decay.view(bsz, h, 1, 1)
        + (x.view(bsz, h, p) * dt.unsqueeze(-1))[..., None] * bh
    )
    out = pool.clone()
    out[slots] = st
    return out, (st * ch).sum(-1).reshape(bsz, h * p)


def test_kernel_builds_where_a_c_compiler_exists() -> None:
    assert ssm_step.available()


SHAPES = [(1, 4, 8, 16, 1), (5, 8, 16, 32, 2), (16, 6, 4, 23, 3), (3, 2, 64, 128, 2)]


@pytest.mark.parametrize(("bsz", "h", "p", "n", "g"), SHAPES)
def test_matches_torch_and_touches_only_its_slots(bsz, h, p, n, g) -> None:
    gen = torch.Generator().manual_seed(bsz * 100 + n)
    pool = torch.randn(bsz + 4, h, p, n, generator=gen)
    slots = torch.randperm(bsz + 4, generator=gen)[:bsz]
    x, b, c = (torch.randn(bsz, k, generator=gen) for k in (h * p, g * n, g * n))
    dt = torch.rand(bsz, h, generator=gen)
    decay = torch.exp(-dt * torch.rand(h, generator=gen))
    want_pool, want_y = reference(pool, slots, x, dt, decay, b, c)
    y = ssm_step.mamba2_decode_step(pool, slots, x, dt, decay, b, c)
    torch.testing.assert_close(pool, want_pool, rtol=1e-6, atol=1e-6)  # others untouched
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=2e-6 * n**0.5)


def test_wrong_shapes_are_refused() -> None:
    pool, slots = torch.zeros(4, 2, 3, 8), torch.tensor([0, 1])
    x, dt, b = torch.zeros(2, 6), torch.zeros(2, 2), torch.zeros(2, 8)
    with pytest.raises(ValueError, match="shapes"):
        ssm_step.mamba2_decode_step(pool, slots, x, dt, dt, b, torch.zeros(2, 9))


def test_applies_only_to_fp32_cpu_contiguous_pools() -> None:
    assert ssm_step.applies(torch.zeros(2, 2, 2, 2))
    assert not ssm_step.applies(torch.zeros(2, 2, 2, 2, dtype=torch.bfloat16))
    assert not ssm_step.applies(torch.zeros(2, 2, 2, 4)[..., ::2])


def test_env_switch_turns_the_kernel_off() -> None:
    code = "from marconi.layers import ssm_step; print(ssm_step.available())"
    env = {**os.environ, "MARCONI_SSM_STEP_KERNEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def _decode_meta(slots: list[int]):
    from marconi.layers.batch_meta import build_batch_meta
    from marconi.models.batch import SequenceInput

    reqs = [SequenceInput([7], list(range(5 * i, 5 * i + 5)), s) for i, s in enumerate(slots)]
    return build_batch_meta(reqs, torch.device("cpu"))


@pytest.mark.parametrize(
    ("slots", "conv_bias", "dt_limit"),
    [([3], True, (0.0, float("inf"))), ([5, 0, 2], False, (0.01, 0.5)), ([1, 4], True, (0.0, 1.0))],
)
def test_fused_decode_matches_the_torch_mixer_path(slots, conv_bias, dt_limit) -> None:
    """The fused kernel = Mamba2Mixer's torch decode path + gated RMSNorm, outputs and both
    pools (every slot: the others must stay untouched)."""
    from marconi.layers.mamba2 import Mamba2Mixer
    from marconi.layers.norm import gated_rms_norm

    torch.manual_seed(len(slots))
    mixer = Mamba2Mixer(32, 4, 8, 2, 16, 4, 16, 1e-5, conv_bias=conv_bias, dt_limit=dt_limit)
    with torch.no_grad():
        for prm in mixer.parameters():
            prm.normal_(0.0, 0.5)
    meta = _decode_meta(slots)
    assert meta.is_decode
    proj = torch.randn(len(slots), mixer.in_proj.out_features) * 2
    conv = torch.randn(6, mixer.d_conv - 1, mixer.conv_dim)
    ssm = torch.randn(6, 4, 8, 16)
    assert ssm_step.fused_applies(proj, conv, ssm)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    with torch.no_grad():
        want = mixer._decode(proj, meta, conv_ref, ssm_ref)
        want = gated_rms_norm(want, proj[:, : mixer.inner], mixer.norm.weight, 16, mixer.eps)
        got = mixer._part(proj, meta, conv, ssm)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ssm_ref, rtol=1e-5, atol=1e-5)


def test_fused_decode_refuses_pools_of_another_shape() -> None:
    prm = ssm_step.FusedParams(
        *(torch.zeros(4, 24), None, torch.zeros(2), torch.zeros(2), torch.zeros(8)),
        torch.ones(8), (0.0, 1.0), 1, 8, 1e-5,
    )  # fmt: skip
    proj = torch.zeros(1, 8 + 24 + 2)
    with pytest.raises(ValueError, match="do not fit"):  # C = 24 needs N = 8, pool has N = 4
        ssm_step.mamba2_decode_fused(
            proj, torch.zeros(2, 3, 24), torch.zeros(2, 2, 4, 4), torch.tensor([0]), prm
        )

"""The fused Mamba-2 prefill kernel (``ssm_step.mamba2_prefill_fused``) against the mixer's torch
path (chunked SSD scan + gated RMSNorm): outputs, every slot of both pools, captures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from marconi.layers import ssm_step
from marconi.layers.batch_meta import build_batch_meta
from marconi.layers.mamba2 import Mamba2Mixer
from marconi.layers.norm import gated_rms_norm
from marconi.models.batch import SequenceInput

#: (prefix, new tokens, working slot, {offset among the new tokens: capture slot})
Req = tuple[int, int, int, dict[int, int]]
BATCHES: list[list[Req]] = [
    [(0, 130, 1, {64: 5, 130: 6, 17: 7})],  # one fresh request, captures inside and at the end
    [(5, 40, 2, {0: 5}), (0, 3, 0, {1: 6, 2: 7}), (0, 70, 3, {})],  # resumed, shorter than K-1
    [(9, 1, 4, {}), (0, 1, 1, {0: 8})],  # one new token each (not a decode: one is fresh)
]


def _mixer(head_dim: int, conv_bias: bool, dt_limit: tuple[float, float]) -> Mamba2Mixer:
    torch.manual_seed(head_dim)
    mixer = Mamba2Mixer(48, 4, head_dim, 2, 16, 4, 16, 1e-5, conv_bias=conv_bias, dt_limit=dt_limit)
    with torch.no_grad():
        for prm in mixer.parameters():
            prm.normal_(0.0, 0.5)
        mixer.A_log.uniform_(-1.0, 1.0)
    return mixer


def _meta(reqs: list[Req]):
    seqs = []
    for prefix, new, slot, caps in reqs:
        pos = tuple(prefix + off for off in caps)
        seqs.append(
            SequenceInput([7] * new, list(range(prefix + new)), slot, pos, tuple(caps.values()))
        )
    return build_batch_meta(seqs, torch.device("cpu"))


def _torch_path(mixer: Mamba2Mixer, proj, meta, conv, ssm) -> torch.Tensor:
    y = mixer._prefill(proj, meta, conv, ssm)
    z = proj[:, : mixer.inner]
    return gated_rms_norm(y, z, mixer.norm.weight, mixer.inner // mixer.n_groups, mixer.eps)


@pytest.mark.parametrize("head_dim", [8, 64])  # 64: the kernel's constant-P path
@pytest.mark.parametrize("batch", range(len(BATCHES)))
def test_prefill_kernel_matches_the_torch_scan(head_dim: int, batch: int) -> None:
    limit = (0.0, float("inf")) if batch else (0.01, 0.5)
    mixer = _mixer(head_dim, conv_bias=batch != 1, dt_limit=limit)
    meta = _meta(BATCHES[batch])
    assert not meta.is_decode
    gen = torch.Generator().manual_seed(batch)
    proj = torch.randn(meta.num_tokens, mixer.in_proj.out_features, generator=gen)
    conv = torch.randn(9, mixer.d_conv - 1, mixer.conv_dim, generator=gen)
    ssm = torch.randn(9, *mixer.ssm_state_shape, generator=gen)
    assert ssm_step.prefill_applies(proj, conv, ssm)
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    with torch.no_grad():
        want = _torch_path(mixer, proj, meta, conv_ref, ssm_ref)
        got = mixer._part(proj, meta, conv, ssm)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)  # every slot, captures included
    torch.testing.assert_close(ssm, ssm_ref, rtol=1e-4, atol=1e-4)


def test_a_prefill_split_anywhere_computes_exactly_one_pass() -> None:
    """Resuming from a state the kernel itself left gives the same bits as one pass: the
    recurrence runs token by token in the same order either way (so a cache hit cannot change
    a Mamba-2 layer's output)."""
    mixer = _mixer(64, conv_bias=True, dt_limit=(0.0, float("inf")))
    proj = torch.randn(100, mixer.in_proj.out_features)
    pools = [torch.zeros(3, mixer.d_conv - 1, mixer.conv_dim), torch.zeros(3, 4, 64, 16)]
    with torch.no_grad():
        whole = mixer._part(proj, _meta([(0, 100, 0, {})]), *pools)
        ends = [p[0].clone() for p in pools]
        head = mixer._part(proj[:37], _meta([(0, 37, 1, {})]), *pools)
        tail = mixer._part(proj[37:], _meta([(37, 63, 1, {})]), *pools)
    assert torch.equal(torch.cat([head, tail]), whole)
    assert all(torch.equal(p[1], e) for p, e in zip(pools, ends, strict=True))


def test_prefill_kernel_refuses_rows_that_do_not_fit_the_batch() -> None:
    mixer = _mixer(8, conv_bias=True, dt_limit=(0.0, float("inf")))
    meta = _meta([(0, 5, 0, {})])
    proj = torch.zeros(4, mixer.in_proj.out_features)
    pools = torch.zeros(2, 3, mixer.conv_dim), torch.zeros(2, 4, 8, 16)
    with pytest.raises(ValueError, match="rows"):
        ssm_step.mamba2_prefill_fused(proj, *pools, meta, mixer._fused_params())


def _run(code: str, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_kernels_share_torchs_openmp_runtime(tmp_path: Path) -> None:
    """Built with -fopenmp, the kernels resolve libgomp.so.1 to the copy torch loaded: one
    OpenMP runtime (one thread pool, one wait policy) in the process."""
    code = (
        "import torch; from marconi.layers import ssm_step; "
        "assert ssm_step.prefill_kernel() and ssm_step.fused_kernel(); "
        "print(len({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))"
    )
    assert _run(code, MARCONI_CACHE_DIR=str(tmp_path)) == "1"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_compiler_without_openmp_still_builds_the_kernels(tmp_path: Path) -> None:
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nfor a; do [ "$a" = -fopenmp ] && exit 1; done\nexec gcc "$@"\n')
    cc.chmod(0o755)
    code = (
        "from marconi.layers import ssm_step; "
        "print(ssm_step.prefill_kernel() is not None, ssm_step.fused_kernel() is not None)"
    )
    assert _run(code, CC=str(cc), MARCONI_CACHE_DIR=str(tmp_path)) == "True True"


@st.composite
def batches(draw: st.DrawFn) -> list[Req]:
    """1-4 requests, fresh or resumed, 1-70 new tokens, captures at any offset (distinct slots
    that are nobody's working slot)."""
    n = draw(st.integers(1, 4))
    slots = iter(range(n, 4 * n))  # up to 3 captures per request
    reqs = []
    for r in range(n):
        new = draw(st.integers(1, 70))
        offs = draw(st.sets(st.integers(0, new), max_size=3))
        reqs.append((draw(st.sampled_from([0, 0, 3, 21])), new, r, {o: next(slots) for o in offs}))
    return reqs


@settings(max_examples=25, deadline=None)
@given(reqs=batches(), seed=st.integers(0, 2**16))
def test_prefill_kernel_matches_the_torch_scan_on_any_batch(reqs: list[Req], seed: int) -> None:
    mixer = _mixer(8, conv_bias=seed % 2 == 0, dt_limit=(0.0, float("inf")))
    meta = _meta(reqs)
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(meta.num_tokens, mixer.in_proj.out_features, generator=gen)
    pools = (
        torch.randn(16, 3, mixer.conv_dim, generator=gen),
        torch.randn(16, 4, 8, 16, generator=gen),
    )
    refs = tuple(p.clone() for p in pools)
    with torch.no_grad():
        want = _torch_path(mixer, proj, meta, *refs)
        got = ssm_step.mamba2_prefill_fused(proj, *pools, meta, mixer._fused_params())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for p, ref in zip(pools, refs, strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-4, atol=1e-4)

"""The paged decode-attention kernel (``csrc/paged_decode_attention.c``) against attention
written out in float64, and the layer's kernel path against its torch SDPA path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from marconi.layers import attention, build_batch_meta
from marconi.layers.attention import DECODE_KERNEL, PagedAttention, decode_attention
from marconi.models import SequenceInput

CPU = torch.device("cpu")


def reference(q, k_cache, v_cache, slot_lists, scale):
    """softmax(scale q K^T) V per request over its slots, GQA by repeat_interleave, in float64."""
    group = q.shape[1] // k_cache.shape[1]
    outs = []
    for b, slots in enumerate(slot_lists):
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        w = torch.einsum("hd,lhd->hl", q[b].double(), k).mul(scale).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", w, v))
    return torch.stack(outs).float()


def test_kernel_builds_where_a_c_compiler_exists() -> None:
    assert DECODE_KERNEL.get() is not None


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 300), min_size=1, max_size=9),
    hk=st.integers(1, 4),
    group=st.integers(1, 4),
    d=st.sampled_from([8, 16, 23, 64]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_matches_attention_written_out(lens, hk, group, d, threads, seed) -> None:
    """Any lengths (padded index rows), scattered slots, GQA groups, odd head dims, 1-2 threads;
    slots past a request's length are never read (they hold NaN)."""
    gen = torch.Generator().manual_seed(seed)
    pool = sum(lens) + 5
    k_cache = torch.randn(pool, hk, d, generator=gen)
    v_cache = torch.randn(pool, hk, d, generator=gen)
    perm = torch.randperm(pool, generator=gen).tolist()
    slot_lists, at = [], 0
    for n in lens:
        slot_lists.append(perm[at : at + n])
        at += n
    unused = perm[at:]
    k_cache[unused], v_cache[unused] = float("nan"), float("nan")
    # the requests' new tokens are their last slots; prefixes are the rest
    reqs = [SequenceInput([1], s, b) for b, s in enumerate(slot_lists)]
    meta = build_batch_meta(reqs, CPU)
    q = torch.randn(len(lens), hk * group, d, generator=gen)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_attention(q, meta, k_cache, v_cache, d**-0.5)
    finally:
        torch.set_num_threads(n)
    assert got is not None
    want = reference(q, k_cache, v_cache, slot_lists, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_applies_only_to_fp32_cpu_decode_parts() -> None:
    k = torch.randn(8, 2, 4)
    one = build_batch_meta([SequenceInput([1], [0, 1, 2], 0)], CPU)
    assert decode_attention(torch.randn(1, 2, 4), one, k, k, 0.5) is not None
    assert decode_attention(torch.randn(1, 2, 4).double(), one, k.double(), k.double(), 0.5) is None
    two_new = build_batch_meta([SequenceInput([1, 2], [0, 1, 2], 0)], CPU)
    assert decode_attention(torch.randn(2, 2, 4), two_new, k, k, 0.5) is None
    assert decode_attention(torch.randn(1, 2, 4), one, k[:, :, ::2], k[:, :, ::2], 0.5) is None


@pytest.mark.parametrize("rope", [False, True])
def test_layer_kernel_path_equals_its_sdpa_path(
    rope: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode batch through `PagedAttention.forward`: the same output and the same pool as with
    the kernel switched off (torch's gather + masked SDPA)."""
    torch.manual_seed(0)
    layer = PagedAttention(
        32, 6, 2, 16, rope=attention.RotaryEmbedding(16, 10000.0) if rope else None
    )
    lens = [5, 17, 1, 40]
    pool = sum(lens) + 3
    kc, vc = torch.randn(pool, 2, 16), torch.randn(pool, 2, 16)
    slots = torch.randperm(pool).tolist()
    reqs, at = [], 0
    for b, n in enumerate(lens):
        reqs.append(SequenceInput([b + 3], slots[at : at + n], b))
        at += n
    meta = build_batch_meta(reqs, CPU)
    x = torch.randn(len(lens), 32)
    with torch.no_grad():
        k1, v1 = kc.clone(), vc.clone()
        got = layer(x, meta, k1, v1)
        monkeypatch.setattr(attention, "decode_attention", lambda *a: None)
        k2, v2 = kc.clone(), vc.clone()
        want = layer(x, build_batch_meta(reqs, CPU), k2, v2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)

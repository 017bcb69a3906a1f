"""marconi's CPU versions of SGLang's Mamba kernels, against naive per-token references, and the
names ``cpu_binding`` rebinds inside SGLang (this fails loudly if SGLang moves them)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sglang")

from marconi.integrations.sglang import cpu_kernels as K
from marconi.integrations.sglang.cpu_binding import (
    METHODS,
    TARGETS,
    bind_cpu_kernels,
)

G = torch.Generator().manual_seed(0)


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=G) * scale


def conv_ref(x: torch.Tensor, init: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x [dim, L], init [dim, K-1] -> silu(conv) [dim, L]."""
    xp = torch.cat([init, x], dim=1).unsqueeze(0)
    return F.silu(F.conv1d(xp, w.unsqueeze(1), b, groups=w.shape[0]))[0]


def ssm_ref(x, dt, a, b, c, d, h0):
    """Per-token Mamba-2 recurrence: x [L, H, P], dt [L, H] (post-softplus), a [H], b/c [L, G, N],
    h0 [H, P, N] -> y [L, H, P], h."""
    h, ys = h0.clone(), []
    hpg = x.shape[1] // b.shape[1]
    for t in range(x.shape[0]):
        bt, ct = b[t].repeat_interleave(hpg, 0), c[t].repeat_interleave(hpg, 0)  # [H, N]
        h = (
            h * torch.exp(dt[t] * a)[:, None, None]
            + (dt[t][:, None] * x[t])[..., None] * bt[:, None]
        )
        ys.append((h * ct[:, None]).sum(-1) + x[t] * d[:, None])
    return torch.stack(ys), h


def test_every_rebound_name_exists_in_sglang_with_the_arguments_we_accept() -> None:
    bind_cpu_kernels()
    for module, names in TARGETS.items():
        mod = importlib.import_module(module)
        for name in names:
            assert getattr(mod, name) is getattr(K, name.removesuffix("_triton")), (module, name)
    for (module, cls, attr), name in METHODS.items():
        owner = getattr(importlib.import_module(module), cls)
        assert owner.__dict__[attr].__func__ is getattr(K, name)
    from sglang.kernels.ops.mamba.triton_ops import ssd_combined
    from sglang.kernels.ops.mamba.triton_ops.ssu_dispatch import selective_state_update

    # the keyword arguments SGLang's kernels take are a subset of ours (or fall into **kwargs)
    for theirs, ours in (
        (ssd_combined.mamba_chunk_scan_combined, K.mamba_chunk_scan_combined),
        (selective_state_update, K.selective_state_update),
    ):
        params = inspect.signature(ours).parameters
        catch_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        assert catch_all or set(inspect.signature(theirs).parameters) <= set(params)


def test_causal_conv1d_fn_varlen_with_initial_states_writes_conv_states() -> None:
    dim, k, lens = 6, 4, [5, 1, 9]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x, w, bias = rand(dim, sum(lens)), rand(dim, k), rand(dim)
    states = rand(8, dim, k - 1)
    before = states.clone()
    has_init, slots = torch.tensor([True, False, True]), torch.tensor([5, 2, 0])
    out = K.causal_conv1d_fn(x, w, bias, activation="silu", conv_states=states,
                             has_initial_state=has_init, cache_indices=slots,
                             query_start_loc=qsl)  # fmt: skip
    for i, (s, e) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True)):
        init = before[slots[i]] if has_init[i] else torch.zeros(dim, k - 1)
        torch.testing.assert_close(out[:, s:e], conv_ref(x[:, s:e], init, w, bias))
        torch.testing.assert_close(states[slots[i]], torch.cat([init, x[:, s:e]], 1)[:, -(k - 1) :])
    untouched = [j for j in range(8) if j not in slots.tolist()]
    assert torch.equal(states[untouched], before[untouched])


def test_causal_conv1d_update_matches_the_prefill_kernel_token_by_token() -> None:
    dim, k = 5, 4
    w, bias, seq = rand(dim, k), rand(dim), rand(dim, 6)
    full = torch.zeros(3, dim, k - 1)
    K.causal_conv1d_fn(seq, w, bias, activation="silu", conv_states=full,
                       has_initial_state=None, cache_indices=torch.tensor([1]),
                       query_start_loc=torch.tensor([0, 6]))  # fmt: skip
    step = torch.zeros(3, dim, k - 1)
    outs = [K.causal_conv1d_update(seq[:, t].unsqueeze(0), step, w, bias, "silu",
                                   conv_state_indices=torch.tensor([1]))[0]
            for t in range(6)]  # fmt: skip
    torch.testing.assert_close(
        torch.stack(outs, 1), conv_ref(seq, torch.zeros(dim, k - 1), w, bias)
    )
    torch.testing.assert_close(step, full)


@pytest.mark.parametrize("chunk", [4, 16])
def test_mamba_chunk_scan_combined_varlen_equals_the_recurrence(chunk: int) -> None:
    h, p, g, n, lens = 4, 3, 2, 5, [7, 1, 13]
    t = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x, dt, a = rand(1, t, h, p), rand(1, t, h), -torch.rand(h, generator=G) - 0.1
    b, c, d, dt_bias = rand(1, t, g, n), rand(1, t, g, n), rand(h), rand(h, scale=0.1)
    init = rand(3, h, p, n)
    out = torch.empty(1, t, h, p)
    states = K.mamba_chunk_scan_combined(x, dt, a, b, c, chunk, D=d, dt_bias=dt_bias,
                                         initial_states=init, cu_seqlens=cu, dt_softplus=True,
                                         out=out, return_varlen_states=True,
                                         state_dtype=torch.float32, seq_idx=None)  # fmt: skip
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        dts = F.softplus(dt[0, s:e] + dt_bias)
        y, hf = ssm_ref(x[0, s:e], dts, a, b[0, s:e], c[0, s:e], d, init[i])
        torch.testing.assert_close(out[0, s:e], y, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(states[i], hf, atol=1e-5, rtol=1e-4)


def test_selective_state_update_mamba2_heads_and_mamba1_layout() -> None:
    # Mamba-2: heads share B/C per group; state rows picked by state_batch_indices
    bsz, h, p, g, n = 3, 4, 2, 2, 5
    state = rand(6, h, p, n)
    before = state.clone()
    x, dt = rand(bsz, h, p), rand(bsz, h, 1).expand(bsz, h, p)
    a = (-torch.rand(h, generator=G) - 0.1)[:, None, None].expand(h, p, n)
    b, c, d = rand(bsz, g, n), rand(bsz, g, n), rand(h)[:, None].expand(h, p)
    dt_bias = rand(h, scale=0.1)[:, None].expand(h, p)
    idx, out = torch.tensor([4, 0, 2]), torch.empty(bsz, h, p)
    K.selective_state_update(state, x, dt, a, b, c, d, dt_bias=dt_bias, dt_softplus=True,
                             state_batch_indices=idx, out=out)  # fmt: skip
    for r in range(bsz):
        dts = F.softplus(dt[r, :, 0] + dt_bias[:, 0])
        y, hn = ssm_ref(x[r : r + 1], dts[None], a[:, 0, 0], b[r : r + 1], c[r : r + 1],
                        d[:, 0], before[idx[r]])  # fmt: skip
        torch.testing.assert_close(out[r], y[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state[idx[r]], hn, atol=1e-5, rtol=1e-4)
    # Mamba-1 (SGLang's full-rank layout: heads = d_inner, head_dim 1, one group, silu gate)
    dim = 6
    state1 = rand(2, dim, 1, n)
    x1, dt1, z1 = rand(1, dim, 1), rand(1, dim, 1), rand(1, dim, 1)
    a1, b1, c1, d1 = -torch.rand(dim, 1, n, generator=G), rand(1, 1, n), rand(1, 1, n), rand(dim, 1)
    h0 = state1[1, :, 0].clone()
    out1 = K.selective_state_update(state1, x1, dt1, a1, b1, c1, d1, z=z1, dt_softplus=True,
                                    state_batch_indices=torch.tensor([1]))  # fmt: skip
    dts = F.softplus(dt1[0, :, 0])
    hn = h0 * torch.exp(dts[:, None] * a1[:, 0]) + (dts * x1[0, :, 0])[:, None] * b1[0]
    y = ((hn * c1[0]).sum(-1) + x1[0, :, 0] * d1[:, 0]) * F.silu(z1[0, :, 0])
    torch.testing.assert_close(out1[0, :, 0], y, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state1[1, :, 0], hn, atol=1e-5, rtol=1e-4)


def test_mamba1_prefill_scan_equals_sglang_reference_loop() -> None:
    from sglang.srt.layers.attention.mamba.mamba1 import MambaMixer1

    t, dim, n = 9, 5, 3
    args = dict(x=rand(t, dim), dt=F.softplus(rand(t, dim)), A=-torch.rand(dim, n, generator=G),
                B=rand(t, n), C=rand(t, n), h0=rand(dim, n))  # fmt: skip
    bind_cpu_kernels()
    h, y = MambaMixer1._selective_scan(**args)
    # SGLang's own loop (kept in the class's source) as the reference, re-run here by hand
    href, ys = args["h0"], []
    for i in range(t):
        da = torch.exp(args["dt"][i][:, None] * args["A"])
        href = da * href + (args["dt"][i][:, None] * args["B"][i][None, :]) * args["x"][i][:, None]
        ys.append((href * args["C"][i][None, :]).sum(-1))
    torch.testing.assert_close(h, href, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, torch.stack(ys), atol=1e-5, rtol=1e-4)


def test_unsupported_modes_raise_instead_of_computing_something_else() -> None:
    x = rand(1, 4, 2, 2)
    with pytest.raises(NotImplementedError, match="extra_buffer"):
        K.mamba_chunk_scan_combined(x, rand(1, 4, 2), -torch.ones(2), rand(1, 4, 1, 3),
                                    rand(1, 4, 1, 3), 4, cu_seqlens=torch.tensor([0, 4]),
                                    return_varlen_states=True,
                                    track_end_locs=torch.tensor([2]))  # fmt: skip
    with pytest.raises(NotImplementedError, match="speculative"):
        K.selective_state_update(rand(1, 2, 2, 3), rand(1, 2, 2), rand(1, 2, 2),
                                 -torch.ones(2, 2, 3), rand(1, 1, 3), rand(1, 1, 3),
                                 disable_state_update=True)  # fmt: skip

"""Kernel-level checks against naive references, and loader / tokenizer / memory contracts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from marconi.layers import build_batch_meta, ssd_scan
from marconi.layers.mamba1 import selective_scan
from marconi.models import (
    ByteTokenizer,
    HybridMemory,
    ModelLoadError,
    SequenceInput,
    ensure_tiny,
    load_model,
    load_tokenizer,
)


def _naive_ssd(x, dt, a, b, c, init):
    """Token-by-token Mamba-2 recurrence; returns outputs and the state after every token."""
    h = init.clone()
    hpg = x.shape[1] // b.shape[1]
    ys, states = [], []
    for t in range(x.shape[0]):
        bt = b[t].repeat_interleave(hpg, 0)
        ct = c[t].repeat_interleave(hpg, 0)
        h = h * torch.exp(dt[t] * a).view(-1, 1, 1) + (dt[t].view(-1, 1) * x[t]).unsqueeze(
            -1
        ) * bt.unsqueeze(1)
        ys.append(torch.einsum("hpn,hn->hp", h, ct))
        states.append(h.clone())
    return torch.stack(ys), states


@pytest.mark.parametrize("prefix", [0, 5])
def test_ssd_scan_matches_recurrence_and_captures_any_position(prefix: int) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, p, gr, ns = 23, 4, 3, 2, 5
    x, b, c = (
        torch.randn(n, h, p, generator=g),
        torch.randn(n, gr, ns, generator=g),
        torch.randn(n, gr, ns, generator=g),
    )
    dt = torch.rand(n, h, generator=g) * 0.5
    a = -torch.rand(h, generator=g) - 0.1
    init = torch.randn(1, h, p, ns, generator=g)
    caps = (prefix + 3, prefix + 8, prefix + 16, prefix + n)
    req = SequenceInput([0] * n, list(range(prefix + n)), 0, caps, (1, 2, 3, 4))
    meta = build_batch_meta([req], torch.device("cpu"))
    plan = meta.segment_plan(8)
    y, final, captured = ssd_scan(x, dt, a, b, c, plan, init)
    ref_y, ref_states = _naive_ssd(x, dt, a, b, c, init[0])
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[0], ref_states[-1], atol=1e-5, rtol=1e-5)
    got = {int(s): st[0] for slots, st in captured for s in slots}
    for pos, slot in zip(caps, (1, 2, 3, 4), strict=True):
        torch.testing.assert_close(got[slot], ref_states[pos - prefix - 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n", [23, 24])
def test_ssd_scan_dense_plan_matches_recurrence(n: int) -> None:
    """One request, chunk-aligned segments: the scan runs on views (n = 24) or one tail pad."""
    g = torch.Generator().manual_seed(1)
    h, p, gr, ns = 4, 3, 2, 5
    x = torch.randn(n, h, p, generator=g)
    b, c = torch.randn(n, gr, ns, generator=g), torch.randn(n, gr, ns, generator=g)
    dt = torch.rand(n, h, generator=g) * 0.5
    a = -torch.rand(h, generator=g) - 0.1
    init = torch.randn(1, h, p, ns, generator=g)
    req = SequenceInput([0] * n, list(range(n)), 0, (16,), (1,))
    plan = build_batch_meta([req], torch.device("cpu")).segment_plan(8)
    assert plan.dense
    y, final, captured = ssd_scan(x, dt, a, b, c, plan, init)
    ref_y, ref_states = _naive_ssd(x, dt, a, b, c, init[0])
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[0], ref_states[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(captured[0][1][0], ref_states[15], atol=1e-5, rtol=1e-5)


def test_ssd_scan_uneven_requests_match_recurrence_each() -> None:
    """Requests with different prefixes, lengths and segment counts in one pass: each one's
    outputs, final state and captures equal its own recurrence (the later steps of the scan
    advance only the requests that still have segments)."""
    g = torch.Generator().manual_seed(2)
    h, p, gr, ns = 4, 3, 2, 5
    prefixes, lens = (0, 5, 13, 2), (3, 23, 9, 1)
    caps = {1: (5 + 8, 5 + 23), 2: (13 + 2,)}
    reqs, slot = [], 1
    for r, (pre, n) in enumerate(zip(prefixes, lens, strict=True)):
        pos = caps.get(r, ())
        reqs.append(
            SequenceInput(
                [0] * n, list(range(pre + n)), 0, pos, tuple(range(slot, slot + len(pos)))
            )
        )
        slot += len(pos)
    t = sum(lens)
    x = torch.randn(t, h, p, generator=g)
    b, c = torch.randn(t, gr, ns, generator=g), torch.randn(t, gr, ns, generator=g)
    dt = torch.rand(t, h, generator=g) * 0.5
    a = -torch.rand(h, generator=g) - 0.1
    init = torch.randn(len(lens), h, p, ns, generator=g)
    init_copy = init.clone()
    plan = build_batch_meta(reqs, torch.device("cpu")).segment_plan(8)
    y, final, captured = ssd_scan(x, dt, a, b, c, plan, init)
    torch.testing.assert_close(init, init_copy, rtol=0, atol=0)  # the caller's tensor
    got = {int(s): st for slots, sts in captured for s, st in zip(slots, sts, strict=True)}
    start, slot = 0, 1
    for r, n in enumerate(lens):
        rows = slice(start, start + n)
        ref_y, ref_states = _naive_ssd(x[rows], dt[rows], a, b[rows], c[rows], init[r])
        torch.testing.assert_close(y[rows], ref_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[r], ref_states[-1], atol=1e-5, rtol=1e-5)
        for pos in caps.get(r, ()):
            off = pos - prefixes[r]
            torch.testing.assert_close(got[slot], ref_states[off - 1], atol=1e-5, rtol=1e-5)
            slot += 1
        start += n


def test_selective_scan_captures_intermediate_states() -> None:
    g = torch.Generator().manual_seed(1)
    r, n, d, ns = 1, 10, 3, 4
    x, dt = torch.randn(r, n, d, generator=g), torch.rand(r, n, d, generator=g)
    a, b, c = (
        -torch.rand(d, ns, generator=g),
        torch.randn(r, n, ns, generator=g),
        torch.randn(r, n, ns, generator=g),
    )
    init = torch.randn(r, d, ns, generator=g)
    y, final, caps = selective_scan(
        x, dt, a, b, c, init, (torch.tensor([0, 0]), torch.tensor([2, 6])), block=4
    )
    h = init[0]
    for t in range(n):
        h = torch.exp(dt[0, t, :, None] * a) * h + (dt[0, t] * x[0, t])[:, None] * b[0, t]
        torch.testing.assert_close(y[0, t], h @ c[0, t])
        if t in (2, 6):
            assert caps is not None
            torch.testing.assert_close(caps[[2, 6].index(t)], h)
    torch.testing.assert_close(final[0], h)


def test_memory_copy_state_is_independent() -> None:
    cfg = load_model("tiny").config
    mem = HybridMemory(cfg, num_kv_slots=4, num_state_slots=3)
    mem.ssm[:, 0] = 1.0
    mem.conv[:, 0] = 2.0
    mem.copy_state(0, 2)
    mem.ssm[:, 0] = 5.0
    assert bool((mem.ssm[:, 2] == 1.0).all()) and bool((mem.conv[:, 2] == 2.0).all())
    assert mem.state_bytes_per_slot > 10 * mem.kv_bytes_per_slot  # SSM states dwarf one token's KV


def test_loader_errors_name_the_problem(tmp_path: Path) -> None:
    src = ensure_tiny("tiny")
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["FooForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'FooForCausalLM'"):
        load_model(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    del tensors["backbone.layers.0.mixer.A_log"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing.*layers\.0\.mixer\.A_log"):
        load_model(bad)


def test_tiny_is_deterministic_and_byte_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = load_model("tiny").lm_head.weight
    monkeypatch.setenv("MARCONI_CACHE_DIR", str(tmp_path))
    b = load_model("tiny").lm_head.weight
    assert torch.equal(a, b) and (tmp_path / "models" / "tiny" / "config.json").is_file()
    tok = load_tokenizer(ensure_tiny("tiny"))  # the folder's tokenizer.json: ids are bytes
    assert tok.eos_token_id == 257 and tok.encode("héllo") == ByteTokenizer().encode("héllo")
    assert tok.decode(tok.encode("héllo")) == "héllo"
    spec = load_model("tiny").config.sublayers
    kinds = [s.kind for s in spec]
    assert kinds.count("mamba2") / kinds.count("attention") == 6

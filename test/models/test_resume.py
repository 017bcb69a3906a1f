"""Resuming from a state captured mid-prefill reproduces the one-pass logits exactly."""

from __future__ import annotations

import pytest
import torch
from marconi.layers import build_batch_meta
from marconi.models import ForwardBatch, HybridMemory, SequenceInput, load_model
from model_helpers import prefill

N, K1, K2 = 200, 64, 150  # tiny's chunk is 64: K1 is chunk-aligned, K2 is not
FRESH = 512  # KV slots of resumed tokens start here, away from the one-pass slots


@pytest.fixture(scope="module", params=["tiny", "tiny-jamba"])
def model_and_ids(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MARCONI_CACHE_DIR", str(tmp_path_factory.mktemp("resume-cache")))
    torch.set_num_threads(1)
    model = load_model(request.param)
    mp.undo()
    ids = torch.randint(0, 256, (N + 8,), generator=torch.Generator().manual_seed(3)).tolist()
    return model, ids


def test_resume_from_captured_states_matches_one_pass(model_and_ids) -> None:
    model, ids = model_and_ids
    mem = model.allocate_memory(num_kv_slots=1024, num_state_slots=8)
    one_pass = prefill(model, mem, ids[:N], range(N), 0, captures={K1: 1, K2: 2, 0: 6, N: 7})
    final = mem.read_state(0)
    torch.testing.assert_close(mem.read_state(7), final, atol=0, rtol=0)
    assert mem.read_state(6).ssm.abs().max() == 0  # state before any token: zeros
    for k, slot in ((K1, 1), (K2, 2)):
        mem.copy_state(slot, 3)
        kv = [*range(k), *range(FRESH + k, FRESH + N)]
        rest = prefill(model, mem, ids[k:N], kv, 3)
        torch.testing.assert_close(rest, one_pass[k:], atol=1e-5, rtol=0)
        torch.testing.assert_close(mem.read_state(3), final, atol=1e-5, rtol=1e-5)


def test_uncached_logits_differ_from_cached(model_and_ids) -> None:
    """Guard against a vacuous resume test: a wrong (zero) state must change the logits."""
    model, ids = model_and_ids
    mem = model.allocate_memory(num_kv_slots=1024, num_state_slots=4)
    one_pass = prefill(model, mem, ids[:N], range(N), 0)
    mem.zero_states(3)
    wrong = prefill(model, mem, ids[K2:N], [*range(K2), *range(FRESH + K2, FRESH + N)], 3)
    assert (wrong - one_pass[K2:]).abs().max() > 1e-3


def test_mixed_batch_with_and_without_prefix(model_and_ids) -> None:
    model, ids = model_and_ids
    other = ids[::-1][:90]
    mem = model.allocate_memory(num_kv_slots=1024, num_state_slots=8)
    one_pass = prefill(model, mem, ids[:N], range(N), 0, captures={K2: 1})
    solo_other = prefill(model, mem, other, range(300, 390), 4)
    mem.copy_state(1, 2)
    batch = ForwardBatch(
        (
            SequenceInput(other, list(range(400, 490)), 5, (40,), (6,)),
            SequenceInput(ids[K2:N], [*range(K2), *range(FRESH + K2, FRESH + N)], 2),
        ),
        return_all_logits=True,
    )
    out = model(batch, mem)
    assert out.all_logits is not None
    torch.testing.assert_close(out.all_logits[0], solo_other, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.all_logits[1], one_pass[K2:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits[1], one_pass[-1], atol=1e-5, rtol=0)
    # one batched decode step for both continues each sequence exactly
    nxt = [int(out.logits[0].argmax()), int(out.logits[1].argmax())]
    dec = model(
        ForwardBatch(
            (
                SequenceInput([nxt[0]], list(range(400, 491)), 5),
                SequenceInput([nxt[1]], [*range(K2), *range(FRESH + K2, FRESH + N + 1)], 2),
            )
        ),
        mem,
    ).logits
    ref0 = prefill(model, mem, [*other, nxt[0]], range(700, 791), 4)[-1]
    ref1 = prefill(model, mem, [*ids[:N], nxt[1]], range(800, 1001), 3)[-1]
    torch.testing.assert_close(dec[0], ref0, atol=1e-4, rtol=0)
    torch.testing.assert_close(dec[1], ref1, atol=1e-4, rtol=0)


def test_decodes_then_prefills_in_one_pass_match_separate_passes(model_and_ids) -> None:
    """The engine's mixed step: decodes first, then prefill chunks (one fresh, one resumed with
    a capture). The mixers run the decodes by the recurrent step and the rest by the scan
    (``BatchMeta.split``); logits and every written state equal separate passes."""
    model, ids = model_and_ids
    a, b, c = ids[:60], ids[60:140], ids[140:200]

    def setup() -> HybridMemory:
        mem = model.allocate_memory(num_kv_slots=1024, num_state_slots=8)
        prefill(model, mem, a, range(60), 0)
        prefill(model, mem, b, range(100, 180), 1)
        prefill(model, mem, c[:20], range(300, 320), 2)
        return mem

    reqs = (
        SequenceInput([7], list(range(61)), 0),
        SequenceInput([9], [*range(100, 180), 180], 1),
        SequenceInput(b[:50], list(range(400, 450)), 3),
        SequenceInput(c[20:], list(range(300, 360)), 2, (30, 60), (4, 5)),
    )
    meta = build_batch_meta(reqs, torch.device("cpu"))
    assert meta.split is not None and meta.split[0].rows == slice(0, 2)
    mixed_mem = setup()
    mixed = model(ForwardBatch(reqs, return_all_logits=True), mixed_mem)
    solo_mem = setup()
    assert mixed.all_logits is not None
    for i, req in enumerate(reqs):
        caps = dict(zip(req.capture_positions, req.capture_slots, strict=True))
        solo = prefill(model, solo_mem, req.token_ids, req.kv_slots, req.state_slot, caps)
        torch.testing.assert_close(mixed.all_logits[i], solo, atol=1e-5, rtol=0)
    for slot in range(6):
        got, want = mixed_mem.read_state(slot), solo_mem.read_state(slot)
        torch.testing.assert_close(got.conv, want.conv, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.ssm, want.ssm, atol=1e-5, rtol=1e-5)

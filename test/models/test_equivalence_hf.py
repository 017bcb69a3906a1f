"""Our runtime vs `transformers` on identical random weights (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from marconi.models import load_model
from model_helpers import greedy_decode, prefill

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, STEPS = 128, 37, 16


def _nemotron_h() -> Any:
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64,
        layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention",
                           "mlp", "linear_attention", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    )  # fmt: skip
    return transformers.NemotronHForCausalLM(cfg)


def _granite() -> Any:
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_state=16,
        mamba_n_groups=2, mamba_chunk_size=8, position_embedding_type="rope",
        embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=3.0,
        attention_multiplier=0.2,
    )  # fmt: skip
    return transformers.GraniteMoeHybridForCausalLM(cfg)


def _bamba() -> Any:
    cfg = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, attn_layer_indices=[1],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, mamba_n_heads=8,
        mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
    )  # fmt: skip
    return transformers.BambaForCausalLM(cfg)


def _jamba() -> Any:
    cfg = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, attn_layer_period=4,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
        num_experts_per_tok=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_state=8, mamba_dt_rank=8,
    )  # fmt: skip
    return transformers.JambaForCausalLM(cfg)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-init random weights so that every path moves the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "A_log" in name or name.endswith(("dt_bias", "dt_proj.bias")):
                continue
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(noise * (1.0 if "embed" in name else 0.1))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


@pytest.mark.parametrize(
    "make", [_nemotron_h, _granite, _bamba, _jamba], ids=lambda f: f.__name__[1:]
)
def test_prefill_and_greedy_decode_match_transformers(make: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = make().eval()
    _randomize(hf, 1)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    mem = ours.allocate_memory(num_kv_slots=PROMPT + STEPS + 1, num_state_slots=2)
    ids = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()

    logits = prefill(ours, mem, ids, range(PROMPT), state_slot=0)
    toks, dec_logits = greedy_decode(ours, mem, int(logits[-1].argmax()), PROMPT, STEPS, slot=0)

    # Reference: one full (uncached) prefill of prompt + generated tokens. transformers' Mamba-1
    # path ignores a cached state for multi-token input, so no HF cache is used anywhere.
    full = torch.tensor([ids + toks[:STEPS]])
    with torch.no_grad():
        ref = hf(full).logits[0].float()
    assert ref.std() > 0.1  # logits far from uniform: the comparison has teeth
    torch.testing.assert_close(logits, ref[:PROMPT], atol=1e-4, rtol=0)
    torch.testing.assert_close(dec_logits, ref[PROMPT:], atol=1e-4, rtol=0)
    assert toks[1:] == ref[PROMPT:].argmax(-1).tolist()[:STEPS]

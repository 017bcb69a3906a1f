"""Small drivers shared by the model tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from marconi.models import ForwardBatch, HybridForCausalLM, HybridMemory, SequenceInput


def prefill(
    model: HybridForCausalLM,
    memory: HybridMemory,
    ids: Sequence[int],
    kv_slots: Sequence[int],
    state_slot: int,
    captures: dict[int, int] | None = None,
) -> torch.Tensor:
    """All logits [n, V] of the new tokens `ids` (prefix = kv_slots beyond len(ids))."""
    caps = captures or {}
    req = SequenceInput(list(ids), list(kv_slots), state_slot, tuple(caps), tuple(caps.values()))
    out = model(ForwardBatch((req,), return_all_logits=True), memory)
    assert out.all_logits is not None
    return out.all_logits[0]


def greedy_decode(
    model: HybridForCausalLM, memory: HybridMemory, first: int, start: int, steps: int, slot: int
) -> tuple[list[int], torch.Tensor]:
    """Feed `first` at position `start`, then `steps - 1` greedy tokens; KV slot = position."""
    toks, logits = [first], []
    for i in range(steps):
        pos = start + i
        req = SequenceInput([toks[-1]], list(range(pos + 1)), slot)
        out = model(ForwardBatch((req,)), memory).logits[0]
        logits.append(out)
        toks.append(int(out.argmax()))
    return toks, torch.stack(logits)

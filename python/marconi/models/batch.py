"""The runtime's forward interface: what one batch asks for and what it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceInput:
    """One request's share of a forward pass.

    - `token_ids`: the new tokens to run (>= 1; exactly 1 for a decode step).
    - `kv_slots`: KV slot of every token of the sequence so far: the cached prefix's slots then
      one per new token. `prefix_len = len(kv_slots) - len(token_ids)`; the prefix's KV must
      already be in its slots.
    - `state_slot`: working state slot. With a cached prefix it must hold the SSM states after
      exactly `prefix_len` tokens; with no prefix its content is ignored (zeros are used).
      After the pass it holds the states after the last new token.
    - `capture_positions` / `capture_slots`: for each position p (prefix_len <= p <= prefix_len +
      len(token_ids), counted from sequence start) write the states after the first p tokens
      into the paired slot, computed within this same pass. Capture slots must differ from
      every working slot of the batch.
    """

    token_ids: Sequence[int] | torch.Tensor
    kv_slots: Sequence[int] | torch.Tensor
    state_slot: int
    capture_positions: tuple[int, ...] = ()
    capture_slots: tuple[int, ...] = ()

    @property
    def prefix_len(self) -> int:
        return len(self.kv_slots) - len(self.token_ids)


@dataclass(frozen=True)
class ForwardBatch:
    """Requests run together; `return_all_logits` also returns every new token's logits."""

    requests: tuple[SequenceInput, ...]
    return_all_logits: bool = False


@dataclass(frozen=True)
class ForwardOutput:
    """`logits` [B, vocab]: each request's last new token; `all_logits[b]` [n_b, vocab]."""

    logits: torch.Tensor
    all_logits: tuple[torch.Tensor, ...] | None = None

"""Small drivers shared by the model tests."""

from __future__ import annotations

import platform
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from marconi.layers.ckernel import CKernel, cpu_flags
from marconi.models import ForwardBatch, HybridForCausalLM, HybridMemory, SequenceInput

#: x86 flags of the paths ``portable_build`` makes: plain C (the compiler vectorises what it can
#: without AVX2 / FMA), and the AVX2 + FMA intrinsics a kernel has besides its AVX-512 ones
ISA_FLAGS = {
    "portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
    "avx2": ("-mno-avx512f",),
}


def portable_build(kernel: CKernel, folder: Path, isa: str = "portable") -> Any:
    """``kernel`` compiled into ``folder`` for a narrower instruction set than this CPU's
    (``ISA_FLAGS``; on other CPUs than x86 the C path is portable anyway) and loaded. "avx2"
    skips the test where the CPU has no AVX2 (the build would not run here)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "CI machines have a C compiler"
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if isa == "avx2" and not (x86 and " avx2" in cpu_flags()):
        pytest.skip("no AVX2 on this CPU")
    out = kernel.compile(cc, folder / f"{isa}.so", ISA_FLAGS[isa] if x86 else ())
    return kernel.load(out)


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

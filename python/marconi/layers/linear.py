"""`Linear`: `nn.Linear` with two CPU fast paths for fp32 inference.

- M >= ``PACKED_MIN_ROWS`` rows not taken by the kernels below (prefill, and decode
  batches past ``SKINNY_ROWS``): oneDNN with a weight reordered once into its blocked
  layout, faster than the default MKL sgemm of `F.linear` (~20-25% for prefill on an AMD
  EPYC, one thread; ~1.8x at 4-8 rows on the Intel Xeon of ``docs/performance_log.md``, two
  threads).
- Decode (1 <= M <= ``small_m.MAX_ROWS`` rows, checked first): the C kernel of
  ``marconi.layers.small_m`` when it is enabled (``small_m.set_enabled``; the engine's runner
  enables it only where OpenMP threads sleep at barriers, ``marconi.engine.runner``), which
  then streams the weight faster than one-thread sgemm (``MARCONI_SMALL_M_KERNEL=0``: never).
- Decode batches of ``SKINNY_ROWS`` rows (1-16): the C kernel ``csrc/skinny_linear.c`` on
  torch's OpenMP threads, which streams the weight faster than the packed path at 4-16 rows
  (13-25% with its first tiling on an AVX-512 Intel Xeon; on an AVX2 AMD EPYC 27% at 4 rows,
  ties at 16) and ties (Intel) or beats ~3x (AMD) MKL's sgemm at 1-3
  (``MARCONI_SKINNY_LINEAR=0``: never).

Everything else (and any case either path does not cover) is `F.linear`.

The packed copy is built lazily on first use and rebuilt when the weight changes (its storage or
version counter), so loading weights with `load_state_dict` needs no extra step. It costs one
extra copy of the weight in memory; `set_packed_linear(False)` (or `MARCONI_PACKED_LINEAR=0`)
turns it off. Parameter names and shapes are exactly `nn.Linear`'s.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F
from torch import nn

from marconi.layers import small_m
from marconi.layers.ckernel import CKernel

#: smallest number of rows (tokens) routed to the packed oneDNN kernel (from 4 rows on it beats
#: sgemm on this project's CPU, weights streamed from memory: 465 vs 823 us at 4 rows, 593 vs
#: 1,194 at 8, 5.1 vs 5.5 ms at 256, for a 3072x768 fp32 weight on 2 threads; 1-3 rows: sgemm)
PACKED_MIN_ROWS = int(os.environ.get("MARCONI_PACKED_MIN_ROWS", "4"))

_enabled = os.environ.get("MARCONI_PACKED_LINEAR", "1") != "0"

#: rows (inclusive range) sent to the skinny kernel: decode batches, where it streams the weight
#: faster than the packed path (measured at 4-16 rows, docs/performance_log.md). At 1-3 rows it
#: ties MKL's sgemm on Intel and beats it ~3x on AMD EPYC, where MKL takes a slower code path
#: (3072x768 weight, 1 row: 92 vs 268 us; the tiny model's decode step 11.5 vs 19 ms at batch
#: 1). On an AVX2 AMD EPYC (2 threads) the small model's decode step at batch 1 / 2 / 4 took
#: 20-24 / 20-23 / 27-29 ms with its AVX2 tile vs 25-28 / 29-31 / 43-44 before it (when this
#: range stopped at 4 rows there), and at 12 / 16 rows 53-56 / 55-56 ms vs 57-60 / 57-61 with
#: the packed path. ``MARCONI_SKINNY_MAX_ROWS`` sets the top (an A/B knob).
SKINNY_ROWS = (1, int(os.environ.get("MARCONI_SKINNY_MAX_ROWS", "16")))

SKINNY = CKernel(
    "skinny_linear.c",
    "skinny_linear",
    (*[ctypes.c_void_p] * 4, *[ctypes.c_long] * 4),
    "MARCONI_SKINNY_LINEAR",
    cflags=("-fopenmp",),
)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    """``F.linear(x, w, b)`` by the skinny kernel for contiguous fp32 CPU tensors (the caller
    checks), or None without the kernel."""
    fn = SKINNY.get()
    if fn is None:
        return None
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    fn(
        x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
        x.shape[0], w.shape[0], x.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return y


def _packed_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):  # pragma: no cover - torch built without oneDNN
        return False


_AVAILABLE = _packed_available()


def set_packed_linear(enabled: bool) -> None:
    """Turn the packed oneDNN path on or off for every `Linear` (process-wide)."""
    global _enabled
    _enabled = enabled


def packed_linear_enabled() -> bool:
    """Whether large fp32 CPU matmuls go through the packed oneDNN kernel."""
    return _enabled and _AVAILABLE


def packed_primitives(model: nn.Module, max_rows: int) -> int:
    """Most oneDNN primitives the packed path can build for ``model``'s `Linear` layers in steps
    of up to ``max_rows`` rows: one per weight shape (and bias or not) and row count it takes."""
    kinds = {(*m.weight.shape, m.bias is None) for m in model.modules() if isinstance(m, Linear)}
    skinny = range(SKINNY_ROWS[0], SKINNY_ROWS[1] + 1) if SKINNY.get() is not None else range(0)
    rows = sum(1 for m in range(PACKED_MIN_ROWS, max_rows + 1) if m not in skinny)
    return len(kinds) * rows if packed_linear_enabled() else 0


class Linear(nn.Linear):
    """Drop-in `nn.Linear`; see the module docstring for when the packed path is used."""

    _packed: tuple[int, int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dim() == 2
            and x.dtype == torch.float32
            and w.dtype == torch.float32
            and x.device.type == "cpu"
            and not torch.is_grad_enabled()
        ):
            rows = x.shape[0]
            b = self.bias
            plain = w.is_contiguous() and (
                b is None or (b.dtype == torch.float32 and b.is_contiguous())
            )
            if plain and 1 <= rows <= small_m.MAX_ROWS and small_m.enabled():
                return small_m.small_m_linear(x.contiguous(), w, b)
            if (
                plain
                and SKINNY_ROWS[0] <= rows <= SKINNY_ROWS[1]
                and (y := skinny_linear(x.contiguous(), w, b)) is not None
            ):
                return y
            if rows >= PACKED_MIN_ROWS and packed_linear_enabled():
                return torch.ops.mkldnn._linear_pointwise(
                    x.contiguous(), self._packed_weight(), self.bias, "none", [], ""
                )
        return F.linear(x, w, self.bias)

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        cached = self._packed
        if cached is None or cached[:2] != key:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 2048)
            # nn.Module.__setattr__ would not register a plain tuple; keep it off the state dict
            object.__setattr__(self, "_packed", (key[0], key[1], packed))
            return packed
        return cached[2]

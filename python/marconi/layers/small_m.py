"""The small-M linear kernel for decode (``csrc/small_m_linear.c``), built on first use.

Decode batches multiply a handful of rows by every weight matrix, so their speed is how fast
the weights stream from memory. On this project's CPU (one core) torch's sgemm reads a
row-major fp32 weight at ~11 GB/s for 1 row; the C kernel, which walks the weight once, row by
row, against all (<= 4) input rows, reads it at ~20-28 GB/s for one row, ~13 GB/s for four
(``docs/performance_log.md``). From about five rows on, with two threads, sgemm catches up. On
CPUs where one core cannot pull the memory bandwidth (this project's Intel Xeon: ~10 GB/s a
core), ``set_threads(2)`` lets a helper thread stream part of the rows, without OpenMP's
barriers.

Built on first use by ``marconi.layers.ckernel``; without a compiler, or with
``MARCONI_SMALL_M_KERNEL=0``, ``available()`` is false and callers keep ``F.linear``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from marconi.layers.ckernel import CKernel

#: most input rows the kernel takes (its register tile); larger batches use sgemm
MAX_ROWS = 4

KERNEL = CKernel(
    "small_m_linear.c",
    "small_m_linear",
    (*[ctypes.c_void_p] * 4, *[ctypes.c_long] * 3),
    "MARCONI_SMALL_M_KERNEL",
    libs=("-lpthread",),
)


def set_threads(n: int) -> int:
    """Threads the kernel uses: 1 (the caller alone) or 2 (the caller + one helper thread that
    takes chunks of weight rows when it gets a core; see ``csrc/small_m_linear.c``). Returns
    the setting in effect (1 without the kernel or if the helper cannot start)."""
    fn = KERNEL.companion("small_m_set_threads", (ctypes.c_int,), ctypes.c_int)
    return 1 if fn is None else int(fn(2 if n >= 2 else 1))


def stats() -> dict[str, int]:
    """Two-thread counters since start: calls, chunks the helper did, ns the caller waited
    for the helper, stalls (waits over the kernel's threshold, each followed by a back-off),
    and how many A/B periods chose one thread and two (``csrc/small_m_linear.c``)."""
    fn = KERNEL.companion("small_m_stats", (ctypes.c_void_p,))
    out = (ctypes.c_long * 6)()
    if fn is not None:
        fn(out)
    names = ("calls", "helper_chunks", "wait_ns", "stalls", "periods_one", "periods_two")
    return dict(zip(names, out, strict=True))


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return KERNEL.get() is not None


_enabled = True


def set_enabled(on: bool) -> None:
    """Whether ``Linear`` sends decode rows to the kernel (process-wide; the model runner
    decides, ``marconi.engine.runner``). ``small_m_linear`` itself always works."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    """``Linear``'s test: the kernel is wanted (``set_enabled``) and built (``available``)."""
    return _enabled and available()


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: Any = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for contiguous fp32 CPU tensors with 1 <= rows <= MAX_ROWS
    (the caller checks; ``Linear.forward`` does), with ``kernel`` or the built one (then
    ``available()`` must be true)."""
    fn = kernel or KERNEL.get()
    assert fn is not None, "small_m_linear called without the kernel (check available())"
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:  # the C kernel's register tile holds MAX_ROWS rows
        raise ValueError(f"small_m_linear takes 1-{MAX_ROWS} rows, got {m}")
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.data_ptr()
    fn(x.data_ptr(), weight.data_ptr(), b, y.data_ptr(), m, n, k)
    return y

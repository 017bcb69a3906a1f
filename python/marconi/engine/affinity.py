"""Pin the engine's OpenMP threads to CPUs, one each (``--pin-threads``; auto by default).

Unpinned, the kernel may move the two compute threads of a 2-CPU machine onto one CPU for a
moment (the event loop, the HTTP client or any other process wakes on the other), and every
barrier of the step then waits for a time slice. vLLM's CPU worker pins its threads
(``VLLM_CPU_OMP_THREADS_BIND``). Call on the thread that steps the engine, after
``torch.set_num_threads``; other threads (the event loop) stay free to run anywhere.
"""

from __future__ import annotations

import ctypes
import os

import torch

from marconi.layers.ckernel import CKernel

KERNEL = CKernel(
    "affinity.c",
    "pin_omp_threads",
    (ctypes.c_void_p, ctypes.c_long),
    "MARCONI_AFFINITY_KERNEL",
    cflags=("-fopenmp",),
)


def should_pin(requested: bool | None, threads: int, cpus: int) -> bool:
    """``--pin-threads`` (True), ``--no-pin-threads`` (False) or neither (None: auto). Auto pins
    only when the team fills every CPU the process may use (the usual 1 thread per core): then
    no other engine or job can be left a CPU to itself either way. A smaller team stays free,
    since two such engines, each pinned from the first CPU, would share it while another idles."""
    return requested if requested is not None else threads == cpus


def pin_threads(requested: bool | None = True) -> list[int] | None:
    """Pin OpenMP thread ``t`` of the calling thread's team to the ``t``-th CPU this process
    may run on, if ``should_pin(requested, ...)``; returns the CPUs used, or None where it did
    not (not wanted, no kernel, fewer CPUs than threads)."""
    cpus = sorted(os.sched_getaffinity(0))
    n = torch.get_num_threads()
    if not should_pin(requested, n, len(cpus)) or n > len(cpus):
        return None
    fn = KERNEL.get()
    if fn is None:
        return None
    table = (ctypes.c_long * n)(*cpus[:n])
    fn(ctypes.addressof(table), n)
    return cpus[:n]

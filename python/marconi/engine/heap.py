"""The process heap as glibc sees it, and handing its free pages back to the OS (issue 12).

glibc keeps the memory a process frees in its arenas for reuse and returns it to the OS only
from the top of a heap. A server whose steps allocate transient tensors of many sizes (prefill
chunks, batch activations, logits) keeps its peak transient footprint resident as free heap:
the soak (``benchmark/soak.py``, docs/serving.md) measured 350 MB of free arena bytes against
270 MB in use, reached during warm-up and then flat (so not a leak, but RSS that steps up when
a heavier load meets a new peak). ``malloc_trim(0)`` gives those pages back (it calls ``madvise`` on
free pages and moves no live data). ``HeapTrimmer`` calls it from the engine thread once the
engine has been idle for ``settle`` seconds after serving, at most every ``interval`` seconds:
never while requests are in flight, and not in the gap between back-to-back requests, where
the next request would wait for the trim and then fault the same pages back in.
``heap_stats`` is what ``GET /debug/memory`` reports.

Without glibc (musl, macOS) ``heap_stats`` has no heap figures and trimming is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("marconi.engine")
_MB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc (>= 2.33 for mallinfo2)
        return None


_LIBC = _glibc()


def rss_mb() -> float:
    """Resident set size of this process, MB (0 where ``/proc`` is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / _MB


class HeapStats(NamedTuple):
    """One reading, in MB. ``arena``: heap glibc took with brk/mmap for small and mid-sized
    blocks; ``mmapped``: blocks mapped one by one (large tensors, the cache's pools);
    ``in_use``: bytes handed out from the arenas; ``free``: arena bytes free but kept.
    The heap figures are None without glibc."""

    rss: float
    arena: float | None
    mmapped: float | None
    in_use: float | None
    free: float | None


def heap_stats() -> HeapStats:
    if _LIBC is None:
        return HeapStats(round(rss_mb(), 1), None, None, None, None)
    m = _LIBC.mallinfo2()
    mb = [round(x / _MB, 1) for x in (m.arena, m.hblkhd, m.uordblks, m.fordblks)]
    return HeapStats(round(rss_mb(), 1), *mb)


def malloc_trim() -> bool:
    """``malloc_trim(0)``: give every arena's free pages back; False without glibc."""
    return _LIBC is not None and bool(_LIBC.malloc_trim(0))


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` once the engine has been idle for ``settle`` seconds after
    serving (not again until steps ran), at most every ``interval`` seconds. The engine thread
    calls ``tick`` on every pass of its loop (an idle loop passes at least once a second);
    ``trims`` and ``released_mb`` (RSS given back, summed) are reported by ``/debug/memory``."""

    def __init__(
        self, interval: float, settle: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval <= 0:
            raise ValueError("the trim interval must be > 0 seconds (0 means: no trimmer)")
        self.interval, self.settle, self.clock = interval, settle, clock
        self.last = -math.inf  # the first trim may come at once
        self.busy_at = -math.inf  # when requests were last in flight
        self.dirty = False  # steps ran since the last trim
        self.trims = 0
        self.released_mb = 0.0
        self.last_ms = 0.0

    def tick(self, busy: bool) -> bool:
        """``busy``: requests are in flight. Trims if due; True if it did."""
        now = self.clock()
        if busy:
            self.dirty, self.busy_at = True, now
            return False
        if not self.dirty or now - self.busy_at < self.settle or now - self.last < self.interval:
            return False
        before, t0 = rss_mb(), time.perf_counter()
        malloc_trim()
        self.last_ms = (time.perf_counter() - t0) * 1e3
        released = max(0.0, before - rss_mb())
        self.released_mb += released
        self.last, self.dirty = now, False
        self.trims += 1
        log.debug("malloc_trim: %.0f MB back in %.1f ms", released, self.last_ms)
        return True

    def report(self) -> dict[str, float]:
        return {
            "interval_s": self.interval,
            "trims": self.trims,
            "released_mb": round(self.released_mb, 1),
            "last_trim_ms": round(self.last_ms, 2),
        }

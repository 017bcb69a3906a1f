"""The heap readings and the idle heap trimmer (issue 12's soak: RSS held free heap)."""

from __future__ import annotations

import pytest
from marconi.engine import heap
from marconi.engine.heap import HeapTrimmer, heap_stats

glibc = pytest.mark.skipif(heap._LIBC is None, reason="needs glibc's mallinfo2/malloc_trim")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trimmer_trims_once_settled_idle_after_serving_at_most_every_interval() -> None:
    clock = Clock()
    t = HeapTrimmer(5.0, settle=1.0, clock=clock)
    clock.now = 10
    assert not t.tick(busy=False)  # nothing served since it started: nothing to give back
    assert not t.tick(busy=True)  # never while requests are in flight
    clock.now = 10.5
    assert not t.tick(busy=False)  # idle for less than settle: the next request may be close
    clock.now = 11
    assert t.tick(busy=False) and t.trims == 1
    assert not t.tick(busy=False)  # idle again: nothing new to give back
    t.tick(busy=True)
    clock.now = 13
    assert not t.tick(busy=False)  # under the interval since the last trim
    clock.now = 16
    assert t.tick(busy=False) and t.trims == 2
    assert t.report()["trims"] == 2 and t.report()["interval_s"] == 5.0
    with pytest.raises(ValueError):
        HeapTrimmer(0)


@glibc
def test_malloc_trim_gives_back_freed_heap_in_the_middle_of_an_arena() -> None:
    """Blocks freed between live ones stay resident (glibc trims only a heap's top) until
    malloc_trim; the bytes in use do not change."""
    blocks = [bytes(64 * 1024) for _ in range(1024)]  # 64 MB from the arena (below mmap)
    keep = blocks[::8]
    del blocks
    before = heap_stats()
    assert before.free is not None and before.free > 40
    assert heap.malloc_trim()
    after = heap_stats()
    assert before.rss - after.rss > 30, (before, after)
    assert after.in_use is not None and abs(after.in_use - before.in_use) < 4
    assert len(keep) == 128


def test_heap_stats_reads_rss() -> None:
    s = heap_stats()
    assert s.rss > 10
    assert (s.in_use is None) == (heap._LIBC is None)

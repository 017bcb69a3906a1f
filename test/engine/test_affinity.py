"""``--pin-threads``: each OpenMP thread of the engine thread's team on one CPU of its own."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from marconi.engine.affinity import pin_threads

CPUS = sorted(os.sched_getaffinity(0))


def _allowed(tid: int) -> set[int]:
    line = next(
        ln for ln in Path(f"/proc/self/task/{tid}/status").read_text().splitlines()
        if ln.startswith("Cpus_allowed_list")
    )  # fmt: skip
    out: set[int] = set()
    for part in line.split()[1].split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_pins_the_calling_threads_team_and_nothing_else() -> None:
    before = {int(t) for t in os.listdir("/proc/self/task")}
    seen: dict[str, object] = {}

    def engine_thread() -> None:
        torch.set_num_threads(2)
        seen["cpus"] = pin_threads()
        seen["tid"] = threading.get_native_id()
        x = torch.randn(512, 512)
        seen["sum"] = float((x @ x).sum())  # a parallel region on the pinned team
        seen["tasks"] = {
            t: _allowed(t) for t in map(int, os.listdir("/proc/self/task")) if t not in before
        }

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen["cpus"] == CPUS[:2]
    tasks = seen["tasks"]
    assert tasks[seen["tid"]] == {CPUS[0]}  # the team's master: the engine thread
    assert {CPUS[1]} in tasks.values()  # its worker
    assert _allowed(threading.get_native_id()) == set(CPUS)  # this thread stays free

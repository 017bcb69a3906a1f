"""``--pin-threads``: each OpenMP thread of the engine thread's team on one CPU of its own."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from marconi.engine.affinity import pin_threads

CPUS = sorted(os.sched_getaffinity(0))


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
        tids = {int(t) for t in os.listdir("/proc/self/task")} - before
        seen["tasks"] = {t: os.sched_getaffinity(t) for t in tids}

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen["cpus"] == CPUS[:2]
    tasks = seen["tasks"]
    assert tasks[seen["tid"]] == {CPUS[0]}  # the team's master: the engine thread
    assert {CPUS[1]} in tasks.values()  # its worker
    assert os.sched_getaffinity(threading.get_native_id()) == set(CPUS)  # this thread stays free

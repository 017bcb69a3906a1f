"""``--pin-threads``: each OpenMP thread of the engine thread's team on one CPU of its own."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from marconi.engine.affinity import pin_threads, should_pin
from marconi.launch_server import make_parser

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


def test_auto_pins_only_a_team_that_fills_the_cpus() -> None:
    assert should_pin(None, 2, 2) and should_pin(None, 1, 1)
    assert not should_pin(None, 1, 2)  # two such engines would share the first CPU
    assert should_pin(True, 1, 2) and not should_pin(False, 2, 2)


def test_flag_parses_to_on_off_or_auto() -> None:
    parser = make_parser()
    base = ["--model", "tiny"]
    assert parser.parse_args(base).pin_threads is None
    assert parser.parse_args([*base, "--pin-threads"]).pin_threads is True
    assert parser.parse_args([*base, "--no-pin-threads"]).pin_threads is False


def test_auto_leaves_a_smaller_team_free() -> None:
    seen: dict[str, object] = {}

    def engine_thread() -> None:
        torch.set_num_threads(1)
        seen["cpus"] = pin_threads(None)
        seen["mine"] = os.sched_getaffinity(threading.get_native_id())

    n = torch.get_num_threads()
    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    torch.set_num_threads(n)
    assert seen["cpus"] is None or len(CPUS) == 1
    if len(CPUS) > 1:
        assert seen["mine"] == set(CPUS)

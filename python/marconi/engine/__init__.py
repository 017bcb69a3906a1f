"""Serving engine: scheduler (continuous batching, chunked prefill), cache manager (the only
user of ``marconi.cache`` here), model runner, and the offline ``LLM``.

Flow of one step: ``Scheduler.schedule`` -> ``ModelRunner.forward`` / ``sample`` ->
``Scheduler.postprocess``; see ``Engine.step``.
"""

from __future__ import annotations

import os

#: OpenMP threads spin ~3 ms at a barrier (300,000 spins, GNU OpenMP's own figure for its
#: default), then sleep, unless the user set either variable. Set before torch loads libgomp
#: (which reads them once, at load). Measured on a quiet 2-core machine (docs/performance_log.md):
#: sleeping at every barrier (``OMP_WAIT_POLICY=PASSIVE``) made a 256-token prefill step up to
#: 1.75x slower and the 16-session TTFT P95 2,435 vs 1,690 ms; spinning costs nothing once the
#: server is idle (the threads sleep after 3 ms). On a machine shared with other CPU-heavy jobs
#: spinning threads can stall each other (14x measured), so set ``OMP_WAIT_POLICY=PASSIVE`` there.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = "300000"

#: torch's CPU allocator backs tensors of 2 MB and more with transparent huge pages
#: (``madvise(MADV_HUGEPAGE)``; read by libc10 at its first allocation), unless the user set it.
#: A decode step streams every weight once: measured on an AMD EPYC (docs/performance_log.md), the
#: small model's 6-row decode step 33.6 -> 31.6 ms. Without THP in ``madvise`` or ``always``
#: mode (``/sys/kernel/mm/transparent_hugepage/enabled``) it changes nothing.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

#: oneDNN's primitive cache holds 4,096 primitives instead of its default 1,024 (read at its
#: first primitive), unless the user set it; ``Engine`` raises it further before the first
#: forward pass when its step size needs more (``runner.size_onednn_cache``). The packed
#: ``Linear`` path needs one per weight shape and row count: a step holds up to
#: ``chunked_prefill_size`` + ``max_running_requests`` rows, 7 weight shapes x ~270 row counts
#: on tiny / small, so at 1,024 a long-running server's prefill steps evicted each other's
#: primitives and rebuilt them (5-7 ms a prefill on tiny, measured on an AMD EPYC;
#: docs/performance_log.md, fifteenth pass). The cached primitives cost ~40-120 MB more RSS there.
if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ:
    ONEDNN_CAPACITY_SET_BY_USER = True
else:
    ONEDNN_CAPACITY_SET_BY_USER = False
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "4096"

from marconi.engine.config import EngineConfig
from marconi.engine.engine import Engine, EngineStats, RequestError, StepTimes
from marconi.engine.llm import LLM, Completion
from marconi.engine.request import SamplingParams, StepOutput

__all__ = [
    "LLM",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestError",
    "SamplingParams",
    "StepOutput",
    "StepTimes",
]

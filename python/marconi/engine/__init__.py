"""Serving engine: scheduler (continuous batching, chunked prefill), cache manager (the only
user of ``marconi.cache`` here), model runner, and the offline ``LLM``.

Flow of one step: ``Scheduler.schedule`` -> ``ModelRunner.forward`` / ``sample`` ->
``Scheduler.postprocess``; see ``Engine.step``.
"""

from __future__ import annotations

import os

#: OpenMP threads sleep at barriers instead of spinning, unless the user chose otherwise. Set
#: before torch loads libgomp (which reads it once, at load). With GNU OpenMP's default spin, a
#: two-thread 512-token prefill on 2 cores took 14x longer (7.0 s vs 0.5 s) while another job's
#: process ran, and 1.4x against a two-thread torch process; sleeping costs ~10% on a quiet
#: machine and loses to spinning against plain busy loops (``docs/performance.md``).
#: ``OMP_WAIT_POLICY=ACTIVE`` restores spinning on a dedicated machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from marconi.engine.config import EngineConfig
from marconi.engine.engine import Engine, EngineStats, RequestError
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
]

"""Serving engine: scheduler (continuous batching, chunked prefill), cache manager (the only
user of ``marconi.cache`` here), model runner, and the offline ``LLM``.

Flow of one step: ``Scheduler.schedule`` -> ``ModelRunner.forward`` / ``sample`` ->
``Scheduler.postprocess``; see ``Engine.step``.
"""

from __future__ import annotations

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

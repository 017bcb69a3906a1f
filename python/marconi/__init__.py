"""Marconi: prefix caching for hybrid (Attention + SSM) LLMs.

``marconi.LLM`` and ``marconi.SamplingParams`` (the offline engine) are imported lazily, so
``import marconi`` stays cheap for the simulator.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import marconi.engine

        return getattr(marconi.engine, name)
    raise AttributeError(f"module 'marconi' has no attribute {name!r}")

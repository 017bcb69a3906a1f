"""Offline engine: ``LLM(model="tiny", prefix_cache="marconi").generate(prompts, params)``.

Runs the same ``Engine`` as the server, in-process and synchronously: every prompt is queued,
then the engine steps until all are done (so prompts are batched together, as in vLLM's and
SGLang's offline engines).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from marconi.engine.config import EngineConfig
from marconi.engine.engine import Engine
from marconi.engine.request import SamplingParams


@dataclass(frozen=True)
class Completion:
    """One finished request: its tokens, text, why it stopped and how much of it was cached."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    cached_tokens: int


class LLM:
    """``LLM(model=..., prefix_cache=..., **EngineConfig fields)``."""

    def __init__(self, model: str = "tiny", prefix_cache: str = "marconi", **kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, prefix_cache=prefix_cache, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
    ) -> list[Completion]:
        """Completions of ``prompts`` (texts, or lists of token ids), in order. Raises
        ``RequestError`` for a prompt that can never run (nothing is queued then)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        engine = self.engine
        reqs = []
        for p in prompts:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            reqs.append(engine.make_request(np.asarray(ids, dtype=np.int64), params))
        for req in reqs:
            engine.add_request(req)
        while engine.has_unfinished():
            engine.step()
        return [
            Completion(
                tuple(int(t) for t in r.prompt_ids),
                tuple(r.output_ids),
                r.detok.text if r.detok else "",
                r.finish_reason,
                r.cached_tokens,
            )
            for r in reqs
        ]

    def check_integrity(self) -> None:
        self.engine.check_integrity()

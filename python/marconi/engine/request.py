"""Requests: sampling parameters, the engine's per-request state, and what a step reports.

A ``Req`` is created by the API layer (or ``LLM.generate``) and then owned by the engine thread.
Only the engine mutates it; other threads see it through ``StepOutput`` events.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from marconi.cache.lease import Lease
    from marconi.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class SamplingParams:
    """How to pick completion tokens. ``temperature == 0`` is greedy (argmax).

    ``max_tokens=None`` means the engine's default (capped by the context length).
    ``stop``: strings that end the completion (not included in the text).
    ``logit_bias``: ``((token_id, bias), ...)`` added to the logits before sampling
    (-100 bans a token, as in the OpenAI API). ``seed`` makes sampling reproducible.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request: new tokens and text, and, when
    ``finished``, the reason: ``stop``, ``length``, ``abort`` (client gone), ``timeout``
    (waited past the queue timeout), ``shutdown`` (the server stopped first) or ``error`` (a
    fault while serving it; ``error`` names the exception type)."""

    rid: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None


class Detokenizer:
    """Incremental text of a completion: holds back a trailing partial UTF-8 character and any
    tail that could still become a stop string, and cuts the text at the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # the text emitted so far
        self.stopped = False

    def update(self, ids: list[int], final: bool) -> str:
        """The new text for the completion ``ids`` so far; sets ``stopped`` on a stop string."""
        full = self.tokenizer.decode(ids)
        for s in self.stop:
            i = full.find(s)
            if i >= 0:
                full, final, self.stopped = full[:i], True, True
        if not final:
            end = len(full) - self.hold
            while end > 0 and full[end - 1] == "\ufffd":  # maybe an unfinished character
                end -= 1
            full = full[: max(end, len(self.text))]
        delta = full[len(self.text) :]
        self.text = full
        return delta


@dataclass(eq=False)
class Req:
    """One generation request. ``prompt_ids`` is fixed; ``output_ids`` grows.

    Engine bookkeeping: ``fed`` counts tokens of ``prompt_ids + output_ids`` whose KV and state
    are computed (the model has run on them); prefill is done when ``fed >= len(prompt_ids)``.
    """

    rid: str
    prompt_ids: np.ndarray
    params: SamplingParams
    max_new_tokens: int = 0  # resolved by the engine from params and the context length
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    fed: int = 0
    cached_tokens: int = 0
    overtaken: int = 0  # prefill tokens admitted ahead of this request while it was mid-prefill
    lease: Lease | None = None
    detok: Detokenizer | None = None
    generator: object | None = None  # torch.Generator for seeded sampling
    error: str | None = None  # why it failed (finish_reason "error")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt_len

    def fed_tokens(self) -> np.ndarray:
        """The tokens the model has consumed: prompt then outputs but the last."""
        if self.fed <= self.prompt_len:
            return self.prompt_ids[: self.fed]
        extra = np.asarray(self.output_ids[: self.fed - self.prompt_len], dtype=np.int64)
        return np.concatenate([self.prompt_ids, extra])

    def output(self, token_ids: tuple[int, ...], text: str) -> StepOutput:
        return StepOutput(
            self.rid,
            token_ids,
            text,
            self.status is Status.FINISHED,
            self.finish_reason,
            self.prompt_len,
            self.cached_tokens,
            len(self.output_ids),
            self.error,
        )

"""Trace variants where the next turn does not extend exactly the tokens the model was fed.

Each variant rewrites the *outputs* of a loaded chat trace (ShareGPT, SWE) and leaves the inputs
as recorded, so turn k+1's prompt still holds turn k's reply as text, while the tokens turn k
fed to the model (its prompt + its generated tokens) now differ from that history:

* ``reasoning``: every output starts with a reasoning part that the chat template drops from the
  next turn's history (as reasoning models' templates do with ``<think>``). ``share`` is the
  reasoning part's fraction of the output tokens. The shared prefix with the next turn ends at
  the prompt end.
* ``retokenized``: the generated tokens are not the canonical tokenisation of the reply's text
  (a client sends the text back and the server re-tokenises it). In a ``share`` of the replies
  one token, at a uniformly drawn position, was generated as two other tokens; the shared prefix
  ends there, inside the reply.

Generated tokens that the history never repeats get unique negative ids (never equal to a real
token or to each other). Deterministic for a given ``seed``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from marconi.registry import Registry
from marconi.sim.traces import Request, Trace, load_trace

TRACE_VARIANTS: Registry[Trace] = Registry("trace variant")


class _FreshIds:
    """Unique negative token ids, counting down."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def take(self, n: int) -> np.ndarray:
        start = next(self._next)
        for _ in range(n - 1):
            next(self._next)
        return -np.arange(start, start + n, dtype=np.int64)


def _with_output(req: Request, output: np.ndarray) -> Request:
    return Request(req.session_id, req.turn, req.arrival, req.input_ids, output)


@TRACE_VARIANTS.register("reasoning")
def reasoning(trace: Sequence[Request], share: float = 0.5, seed: int = 0) -> Trace:
    """Prefix every output with ``round(share / (1 - share) * len(output))`` reasoning tokens
    (so they are ``share`` of the new output) that the next turn's history does not contain."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"share must be in [0, 1), got {share}")
    del seed  # deterministic without randomness; accepted for a uniform signature
    ids = _FreshIds()
    out = []
    for req in trace:
        n = round(share / (1.0 - share) * req.num_output_tokens)
        output = np.concatenate([ids.take(n), req.output_ids]) if n else req.output_ids
        out.append(_with_output(req, output))
    return out


@TRACE_VARIANTS.register("retokenized")
def retokenized(trace: Sequence[Request], share: float = 1.0, seed: int = 0) -> Trace:
    """In ``share`` of the outputs (of 2+ tokens), replace the token at a uniform position by two
    fresh tokens: the model generated the same text with a different split."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    rng = np.random.default_rng(seed)
    ids = _FreshIds()
    out = []
    for req in trace:
        o = req.output_ids
        if len(o) >= 2 and rng.random() < share:
            u = int(rng.integers(0, len(o)))
            out.append(_with_output(req, np.concatenate([o[:u], ids.take(2), o[u + 1 :]])))
        else:
            out.append(req)
    return out


def parse_variant(spec: str) -> tuple[str, str | None, dict[str, float]]:
    """``"sharegpt+reasoning:share=0.3"`` -> ``("sharegpt", "reasoning", {"share": 0.3})``; a
    spec without ``+`` (or naming an existing file) has no variant."""
    if "+" not in spec or os.path.exists(spec):
        return spec, None, {}
    base, _, rest = spec.rpartition("+")
    name, _, args = rest.partition(":")
    kw: dict[str, float] = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        kw[key] = float(value)
    if name not in TRACE_VARIANTS:
        TRACE_VARIANTS.get(name)  # raises with the choices
    return base, name, kw


def load_variant(spec: str, **loader_kw: Any) -> Trace:
    """Load ``base[+variant[:key=value,...]]``: the base trace (``load_trace(base,
    **loader_kw)``) rewritten by the named variant."""
    base, name, kw = parse_variant(spec)
    trace = load_trace(base, **loader_kw)
    if name is None:
        return trace
    if "seed" in kw:
        kw["seed"] = int(kw["seed"])
    return TRACE_VARIANTS.create(name, trace=trace, **kw)

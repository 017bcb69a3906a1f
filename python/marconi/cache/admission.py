"""Admission policies: where a request checkpoints SSM states (strategy classes + registry).

A policy answers two questions for one request: at which positions of the input the prefill
should capture a state, and at which positions of the decoded continuation. Every captured state
is offered to the tree on insert; positions are absolute (prefix lengths).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from marconi.registry import Registry

if TYPE_CHECKING:
    import numpy as np


class AdmissionContext(NamedTuple):
    """What the cache knows about a request before its prefill."""

    input_len: int
    usable_len: int  # prefix the request resumes from (no capture needed at or before it)
    branch_point: int | None  # where the input branches off the tree (speculative insertion)


class PrefillPlan(NamedTuple):
    """``PrefixCache.plan_prefill``: where the request's prefill captures states, and the
    admission's memo for its insert (``AdmissionPolicy.observe_prefill``)."""

    positions: tuple[int, ...]
    memo: object = None


def _multiples(step: int, lo: int, hi: int) -> tuple[int, ...]:
    """Multiples of ``step`` in ``(lo, hi]``."""
    first = (lo // step + 1) * step
    return tuple(range(first, hi + 1, step))


def _decode_multiples(step: int, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
    """Multiples of ``step`` past the input among decode steps ``[lo, hi)``: the capture points of
    the policies that plan ``step``-aligned decode states."""
    return _multiples(step, max(lo - 1, input_len), hi - 1)


def _last_multiple(step: int, lo: int, hi: int) -> tuple[int, ...]:
    """The largest multiple of ``step`` in ``(lo, hi]``, if any."""
    last = hi - hi % step
    return (last,) if last > lo else ()


#: ``length_bin``'s resolution: bins per doubling of the prefix length
LENGTH_BINS_PER_OCTAVE = 4
LENGTH_BINS = LENGTH_BINS_PER_OCTAVE * 24  # lengths up to 2^24 tokens


def length_bin(tokens: int) -> int:
    """A prefix length's bin for ``AdmissionPolicy.reuse_by_length`` (log-spaced)."""
    return min(int(math.log2(tokens + 1) * LENGTH_BINS_PER_OCTAVE), LENGTH_BINS - 1)


class AdmissionPolicy(ABC):
    """Chooses checkpoint positions. Contract: positions are strictly increasing, within
    ``(usable_len, input_len]`` for prefill and ``(input_len, seq_len]`` for decode."""

    name: ClassVar[str]
    #: whether the policy learns from what requests reuse (then the cache calls ``observe_*``)
    learns: ClassVar[bool] = False

    def observe_prefill(self, tokens: np.ndarray, key_len: int, usable_len: int) -> object:
        """A request with input ``tokens`` may resume from at most ``key_len`` tokens (its match
        key) and resumes from ``usable_len``; called before ``prefill_positions`` for it.
        Returns a memo (None: nothing) that the caller hands back to ``observe_insert`` for the
        same request, so that the policy need not read the input again."""
        return None

    def observe_insert(  # noqa: B027 - optional hook
        self, tokens: np.ndarray, input_len: int, memo: object = None
    ) -> None:
        """A request whose first ``input_len`` tokens were its input inserts ``tokens``;
        ``memo``: what ``observe_prefill`` returned for that input, if the caller kept it."""

    def learned(self) -> dict[str, object] | None:
        """What the policy has learned so far, for reports (``/debug/cache``); None if it
        learns nothing."""
        return None

    @property
    def block_granular(self) -> bool:
        """Whether the reuse this policy has learned is block-granular: later requests resume
        from block-aligned positions of earlier inputs (Mooncake), not from where a request
        ended. Read by a learning eviction policy (``EvictionPolicy.observe_admission``)."""
        return False

    def reuse_by_length(self) -> list[float] | None:
        """How much likelier than average a request that ended at a prefix length is to be
        resumed by a later one, per ``length_bin`` (1.0: average), or None if this policy
        does not learn it. Read by a learning eviction policy at its refits."""
        return None

    @abstractmethod
    def prefill_positions(self, ctx: AdmissionContext) -> tuple[int, ...]: ...

    @abstractmethod
    def decode_positions(self, input_len: int, seq_len: int) -> tuple[int, ...]: ...

    def capture_points(self, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
        """Decode steps ``fed`` in ``[lo, hi)`` where the working state after ``fed`` tokens is
        planned (``fed in decode_positions(input_len, fed + 1)``): where a decoding request
        copies its state out. Policies override this with a closed form (same result)."""
        return tuple(f for f in range(lo, hi) if f in self.decode_positions(input_len, f + 1))

    def _branch(self, ctx: AdmissionContext) -> tuple[int, ...]:
        bp = ctx.branch_point
        return (bp,) if bp is not None and ctx.usable_len < bp <= ctx.input_len else ()


ADMISSION_POLICIES: Registry[AdmissionPolicy] = Registry("admission policy")


@ADMISSION_POLICIES.register("marconi")
class MarconiAdmission(AdmissionPolicy):
    """The paper's taxonomy: the branch point (a purely-input prefix shared with an earlier
    request) and the state after the last decoded token (where a conversation continues).
    At most two new states per request."""

    name = "marconi"

    def prefill_positions(self, ctx: AdmissionContext) -> tuple[int, ...]:
        return self._branch(ctx)

    def decode_positions(self, input_len: int, seq_len: int) -> tuple[int, ...]:
        return (seq_len,) if seq_len > input_len else ()

    def capture_points(self, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
        return ()  # the planned state is always the working one (no copy during decode)


@ADMISSION_POLICIES.register("every-n")
class EveryN(AdmissionPolicy):
    """A state every ``n`` tokens over the whole sequence (vLLM+ in the paper, n = 32)."""

    name = "every-n"

    def __init__(self, n: int = 32) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n

    def prefill_positions(self, ctx: AdmissionContext) -> tuple[int, ...]:
        return _multiples(self.n, ctx.usable_len, ctx.input_len)

    def decode_positions(self, input_len: int, seq_len: int) -> tuple[int, ...]:
        return _multiples(self.n, input_len, seq_len)

    def capture_points(self, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
        return _decode_multiples(self.n, input_len, lo, hi)


@ADMISSION_POLICIES.register("chunk-aligned")
class ChunkAligned(AdmissionPolicy):
    """SGLang 0.5's ``extra_buffer`` mode: the state at the last ``interval``-aligned position
    of the prefill and of the finished sequence, plus a branch checkpoint when the input
    branches off the tree past the deepest state."""

    name = "chunk-aligned"

    def __init__(self, interval: int = 256) -> None:
        self.interval = interval

    def prefill_positions(self, ctx: AdmissionContext) -> tuple[int, ...]:
        aligned = _last_multiple(self.interval, ctx.usable_len, ctx.input_len)
        return tuple(sorted(set(self._branch(ctx) + aligned)))

    def decode_positions(self, input_len: int, seq_len: int) -> tuple[int, ...]:
        return _last_multiple(self.interval, input_len, seq_len)

    def capture_points(self, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
        return _decode_multiples(self.interval, input_len, lo, hi)


@ADMISSION_POLICIES.register("align-junctions")
class AlignJunctions(AdmissionPolicy):
    """vLLM 0.32's ``--mamba-cache-mode align`` with Marconi-style retention: states only on
    ``block``-aligned positions; the latest replay point of the finished sequence and shared-
    prefix junctions (the branch point rounded down to a block boundary). The replay point
    is the last block boundary of the input (prefill) or of the continuation (decode)."""

    name = "align-junctions"

    def __init__(self, block: int = 512) -> None:
        self.block = block

    def prefill_positions(self, ctx: AdmissionContext) -> tuple[int, ...]:
        bp = ctx.branch_point
        junction = () if bp is None else _last_multiple(self.block, ctx.usable_len, bp)
        latest = _last_multiple(self.block, ctx.usable_len, ctx.input_len)
        return tuple(sorted(set(junction + latest)))

    def decode_positions(self, input_len: int, seq_len: int) -> tuple[int, ...]:
        return _last_multiple(self.block, input_len, seq_len)

    def capture_points(self, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
        return _decode_multiples(self.block, input_len, lo, hi)

"""In which order waiting requests are admitted (strategy classes picked from a registry).

``--schedule-policy`` (the name and the ``lpm`` choice follow SGLang's ``launch_server``):

| policy | order |
|--------|-------|
| fcfs   | arrival order |
| lpm    | longest usable cached prefix first, arrival order among equals |
| spf    | fewest uncached prompt tokens first, arrival order among equals |
| srpf   | the default: spf, and a waiting request with fewer tokens left to prefill than |
|        | a running request's prefill remainder takes the step's budget before it, until |
|        | half the remainder's uncached prompt has gone ahead of it                      |

A policy only reorders the waiting queue before admission (and, with ``preempts_prefill``,
lets the front of it go before mid-prefill remainders); the scheduler still admits from the
front while the token budget, the running-request cap and memory allow, so a policy never
changes what a request computes, only when it starts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from marconi.registry import Registry

if TYPE_CHECKING:
    from marconi.engine.request import Req


class SchedulePolicy(ABC):
    """Contract: ``order`` returns a permutation of ``waiting`` (or None: keep the queue's
    order); ``prefix_len(req)`` is read-only (it changes no cache state and no LRU order)."""

    name: ClassVar[str]
    #: whether a waiting request with fewer tokens left to prefill than a running request's
    #: prefill remainder is admitted before that remainder gets the step's budget
    preempts_prefill: ClassVar[bool] = False
    #: with ``preempts_prefill``: the prefill tokens that may go ahead of a mid-prefill request,
    #: as a share of its uncached prompt tokens (None: no bound)
    overtake_share: ClassVar[float | None] = None

    @abstractmethod
    def order(self, waiting: Sequence[Req], prefix_len: Callable[[Req], int]) -> list[Req] | None:
        """The waiting requests in admission order."""


SCHEDULE_POLICIES: Registry[SchedulePolicy] = Registry("schedule policy")


@SCHEDULE_POLICIES.register("fcfs")
class FirstComeFirstServed(SchedulePolicy):
    name = "fcfs"

    def order(self, waiting: Sequence[Req], prefix_len: Callable[[Req], int]) -> list[Req] | None:
        return None


class SortedPolicy(SchedulePolicy):
    """Waiting requests sorted by ``key`` (stable: arrival order among equals). Queues longer
    than ``max_queue`` keep arrival order: looking up every queued request's cached prefix each
    step would cost O(queue x depth)."""

    max_queue: ClassVar[int] = 128

    @abstractmethod
    def key(self, req: Req, prefix_len: int) -> int:
        """Sort key of ``req`` (smaller starts first), given its usable cached prefix."""

    def order(self, waiting: Sequence[Req], prefix_len: Callable[[Req], int]) -> list[Req] | None:
        if not 1 < len(waiting) <= self.max_queue:
            return None
        return sorted(waiting, key=lambda r: self.key(r, prefix_len(r)))


@SCHEDULE_POLICIES.register("lpm")
class LongestPrefixMatch(SortedPolicy):
    """Requests that resume from the longest cached prefix start first: their prefill is the
    cheapest, so they leave the queue soonest, and their prefix is used while it is cached.
    A request with no hit can wait behind a stream of hits (as in SGLang)."""

    name = "lpm"

    def key(self, req: Req, prefix_len: int) -> int:
        return -prefix_len


@SCHEDULE_POLICIES.register("spf")
class ShortestPrefillFirst(SortedPolicy):
    """The request with the fewest prompt tokens left to prefill (prompt minus its usable
    cached prefix) starts first: in a burst of cold arrivals the short ones get their first
    token a step or more sooner, at the cost of the longest one. A long request can wait behind
    a stream of short ones."""

    name = "spf"

    def key(self, req: Req, prefix_len: int) -> int:
        return req.prompt_len - prefix_len


@SCHEDULE_POLICIES.register("srpf")
class ShortestRemainingPrefillFirst(ShortestPrefillFirst):
    """``spf`` that also pauses a long prefill: a request that arrives while a longer one is
    mid-prefill, with fewer tokens left to prefill than its remainder, takes the next step's
    budget first (shortest remaining processing time), so a short turn never waits for all of
    a long prompt's chunks. The long one's first token comes later by the short ones' chunks,
    at most half its own uncached prompt (``overtake_share``): unbounded, a burst of shorter
    arrivals starved a long turn (a 561-token prefill overtaken by 478 tokens took 2.8 s
    instead of 1.4-1.7, the TTFT P95 of its round: docs/performance_log.md)."""

    name = "srpf"
    preempts_prefill = True
    overtake_share = 0.5

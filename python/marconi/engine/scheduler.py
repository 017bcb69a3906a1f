"""The scheduler: which requests run in the next forward pass, and what their results mean.

Continuous batching: every step runs one decode token for each running request whose prefill is
done, plus prefill chunks under a token budget (``chunked_prefill_size``): first the requests
already mid-prefill, then new requests, in the order of the schedule policy (``fcfs``, ``lpm``,
``spf``, ``schedule_policy.py``), admitted while the budget, the running-request cap and memory
allow. A policy that ``preempts_prefill`` (``srpf``) lets a waiting request with fewer tokens
left to prefill than every mid-prefill remainder go first, up to a share of each remainder's
uncached prompt (the paused remainder keeps its memory and its state and resumes in a later
step). Admission reserves all the KV a
request can need, so a running request never runs short and nothing is ever evicted from a
running request or recomputed; a request that does not fit waits until others finish (their
memory goes back to the cache, which evicts as needed).

Fault isolation: every per-request piece of work (admission and its state copy, decode-time
checkpoint copies, slot lookups, stop checks and detokenization, the final insert) runs under
``_isolated``: an exception there fails that request alone (``finish_reason="error"``), frees
what it holds, and leaves every other request's batch and tokens as they were. A request that
waits longer than ``queue_timeout`` seconds before admission ends with ``"timeout"``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from marconi.engine.request import Status, StepOutput
from marconi.engine.schedule_policy import FirstComeFirstServed, SchedulePolicy
from marconi.models.batch import SequenceInput

if TYPE_CHECKING:
    from marconi.engine.cache_manager import CacheManager
    from marconi.engine.request import Req
    from marconi.models.tokenizer import Tokenizer

log = logging.getLogger("marconi.engine")


@dataclass(frozen=True)
class ScheduledBatch:
    """One forward pass: ``inputs[i]`` runs for ``reqs[i]``; ``fed_after[i]`` is the request's
    ``fed`` once it ran; ``samples[i]`` whether its logits pick a token (decode or last chunk)."""

    reqs: tuple[Req, ...]
    inputs: tuple[SequenceInput, ...]
    fed_after: tuple[int, ...]
    samples: tuple[bool, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(i.token_ids) for i in self.inputs)


class Scheduler:
    """Owns the waiting queue and the running set; talks to memory only via ``CacheManager``."""

    def __init__(
        self,
        manager: CacheManager,
        tokenizer: Tokenizer,
        max_running: int,
        prefill_budget: int,
        policy: SchedulePolicy | None = None,
        queue_timeout: float | None = None,
    ) -> None:
        self.manager = manager
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self.policy = policy or FirstComeFirstServed()
        self.queue_timeout = queue_timeout
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str, reason: str = "abort") -> StepOutput | None:
        """Drop a request wherever it is and free what it holds; None if unknown or done."""
        for req in (*self.waiting, *self.running):
            if req.rid == rid:
                return self._drop(req, reason)
        return None

    def fail(self, reqs: Sequence[Req], exc: BaseException) -> list[StepOutput]:
        """Fail ``reqs`` (e.g. a batch whose forward pass raised) and free what they hold."""
        return [
            self._drop(r, "error", _describe(exc)) for r in reqs if r.status is not Status.FINISHED
        ]

    def _drop(self, req: Req, reason: str, error: str | None = None) -> StepOutput:
        if req.status is Status.RUNNING:
            self.running.remove(req)
            if req.lease is not None:
                self.manager.abort(req.lease)
        else:
            self.waiting.remove(req)
        return self._end(req, reason, error)

    @contextmanager
    def _isolated(self, req: Req, failed: list[StepOutput]) -> Iterator[None]:
        """Run one request's share of a step; on an exception, fail it alone (see the module
        docstring), report it in ``failed`` and swallow the exception (the rest of the block,
        that request's work, is skipped)."""
        try:
            yield
        except Exception as e:
            log.exception("%s failed; failing it alone", req.rid)
            if req.status is not Status.FINISHED:
                failed.append(self._drop(req, "error", _describe(e)))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> tuple[ScheduledBatch | None, list[StepOutput]]:
        """The next batch (None when idle), and requests failed at admission."""
        items: list[tuple[Req, SequenceInput, int, bool]] = []
        failed = self._expire()
        for req in [r for r in self.running if not r.prefilling]:
            with self._isolated(req, failed):
                items.append(self._decode(req))
        budget = self.prefill_budget
        mid = [r for r in self.running if r.prefilling]
        if mid and self.policy.preempts_prefill:  # shorter arrivals before the remainders
            mid.sort(key=lambda r: r.prompt_len - r.fed)
            self._reorder(budget)
            budget = self._admit(budget, items, failed, mid)
        for req in mid:
            if budget > 0:
                with self._isolated(req, failed):
                    budget -= self._prefill(req, budget, items)
        self._reorder(budget)
        self._admit(budget, items, failed)
        if not items:
            return None, failed
        reqs, inputs, fed_after, samples = zip(*items, strict=True)
        return ScheduledBatch(reqs, inputs, fed_after, samples), failed

    def _reorder(self, budget: int) -> None:
        """Put the waiting queue in the policy's order, if anything can be admitted now."""
        if budget > 0 and len(self.running) < self.max_running:
            ordered = self.policy.order(self.waiting, lambda r: self.manager.peek(r.prompt_ids))
            if ordered is not None:
                self.waiting = deque(ordered)

    def _admit(
        self, budget: int, items: list, failed: list[StepOutput], ahead_of: Sequence[Req] = ()
    ) -> int:
        """Admit waiting requests from the front and append their first prefill chunks while
        the budget, the running-request cap and memory allow (with ``ahead_of``, mid-prefill
        requests, only while the front one may go ahead of them all: ``_may_overtake``);
        returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            if ahead_of:
                todo = req.prompt_len - self.manager.peek(req.prompt_ids)
                if not all(self._may_overtake(todo, r) for r in ahead_of):
                    break
            max_fed = req.prompt_len + req.max_new_tokens - 1
            lease = None
            with self._isolated(req, failed):
                lease = self.manager.admit(req.prompt_ids, max_fed)
            if req.status is Status.FINISHED:  # admission raised: failed (nothing held)
                continue
            if lease is None:
                if not self.running:  # cannot happen for validated requests; never spin
                    self.waiting.popleft()
                    failed.append(self._end(req, "error", "does not fit in memory"))
                    continue
                break  # wait for running requests to give memory back
            self.waiting.popleft()
            req.lease, req.status = lease, Status.RUNNING
            req.fed = req.cached_tokens = lease.prefix_len
            self.running.append(req)
            for r in ahead_of:
                r.overtaken += req.prompt_len - req.fed
            with self._isolated(req, failed):
                budget -= self._prefill(req, budget, items)
        return budget

    def _may_overtake(self, todo: int, req: Req) -> bool:
        """Whether a prefill of ``todo`` tokens may go ahead of mid-prefill ``req``: it is
        shorter than ``req``'s remainder, and within what the policy lets go ahead of it."""
        if todo >= req.prompt_len - req.fed:
            return False
        share = self.policy.overtake_share
        return share is None or req.overtaken + todo <= share * (req.prompt_len - req.cached_tokens)

    def _expire(self) -> list[StepOutput]:
        """End the requests that waited longer than ``queue_timeout`` (``"timeout"``)."""
        if self.queue_timeout is None or not self.waiting:
            return []
        limit = time.monotonic() - self.queue_timeout
        return [self._drop(r, "timeout") for r in list(self.waiting) if r.arrival < limit]

    def _decode(self, req: Req) -> tuple[Req, SequenceInput, int, bool]:
        lease = req.lease
        assert lease is not None
        self.manager.before_decode(lease, req.fed)
        slots = self.manager.token_slots(lease, 0, req.fed + 1)
        return req, SequenceInput([req.output_ids[-1]], slots, lease.working), req.fed + 1, True

    def _prefill(self, req: Req, budget: int, items: list) -> int:
        """Append the request's next prefill chunk (at most ``budget`` tokens); returns its size."""
        lease = req.lease
        assert lease is not None
        end = min(req.prompt_len, req.fed + budget)
        caps = sorted(self.manager.prefill_captures(lease, req.fed, end).items())
        inp = SequenceInput(
            req.prompt_ids[req.fed : end],
            self.manager.token_slots(lease, 0, end),
            lease.working,
            tuple(p for p, _ in caps),
            tuple(s for _, s in caps),
        )
        items.append((req, inp, end, end == req.prompt_len))
        return end - req.fed

    # ------------------------------------------------------------------ results
    def postprocess(
        self, batch: ScheduledBatch, tokens: Sequence[int | Exception | None]
    ) -> list[StepOutput]:
        """Advance each request by its share of the batch; ``tokens[i]`` is the sampled token of
        item ``i`` (None where it samples nothing, the exception if sampling it raised: that
        request fails alone). Finished requests give their memory back."""
        outs: list[StepOutput] = []
        for req, fed, tok in zip(batch.reqs, batch.fed_after, tokens, strict=True):
            if req.status is not Status.RUNNING:
                continue
            with self._isolated(req, outs):
                if isinstance(tok, Exception):
                    raise tok
                req.fed = fed
                if tok is not None:
                    outs.append(self._advance(req, tok))
        return outs

    def _advance(self, req: Req, tok: int) -> StepOutput:
        req.output_ids.append(tok)
        reason = self._stop_reason(req, tok)
        assert req.detok is not None
        text = req.detok.update(req.output_ids, final=reason is not None)
        if req.detok.stopped:
            reason = "stop"
        if reason is not None:
            assert req.lease is not None
            # the insert hands the request's memory to the tree: if it raises part-way, what
            # it holds is unknown, so the request fails without a second free (logged)
            lease, req.lease = req.lease, None
            self.manager.finish(lease, req.fed_tokens())
            self.running.remove(req)
            req.status, req.finish_reason = Status.FINISHED, reason
        return req.output((tok,), text)

    def _stop_reason(self, req: Req, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and tok == self.tokenizer.eos_token_id:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _end(self, req: Req, reason: str, error: str | None = None) -> StepOutput:
        req.status, req.finish_reason, req.lease, req.error = Status.FINISHED, reason, None, error
        return req.output((), "")


def _describe(exc: BaseException) -> str:
    """What a client is told about an internal fault: its type, not its (internal) text."""
    return type(exc).__name__

"""Admission that learns which candidate positions get reused, from ghost entries.

The paper's taxonomy bets that a later request either shares a purely-input prefix (found by
speculative insertion: the branch point) or extends *exactly* the tokens this one fed (the state
after the last decoded token). Real traffic breaks the second bet often: a reasoning model's
history drops the ``<think>`` part, a client re-tokenises the reply from text, a production
trace repeats the previous turn's input blocks but not its output, a user sends the same prompt
again. So every request proposes a few more candidate positions (``Kind``) and the policy
admits the kinds that pay on this workload:

* Each proposal, admitted or not, leaves a **ghost**: a fingerprint of the prefix at that
  position and the kinds that proposed it (a bounded FIFO table, as ARC / TinyLFU ghost lists).
* When a request arrives, the deepest ghost on its match key (at or above the prefix it resumes
  from) is where a state of that kind would have served it: each kind of that ghost is
  credited the prefix length (would-be hit tokens). The bound is the key, not the KV the tree
  still holds: had the state been admitted, its KV would have stayed with it (the KV-only tail
  of a declined state goes first, and SGLang does not insert it at all), so a kind whose
  states were declined can still earn its way back.
* A kind is admitted while its decayed yield (credited tokens per proposal) is at least
  ``threshold`` times the best kind's. Ghosts are kept for disabled kinds too, so a kind comes
  back when the workload starts to reuse it. Before any credit, ``PRIOR`` holds (the last
  decoded token and one token before the prompt end).

The same ghosts say which *lengths* get resumed (``reuse_by_length``): each request that
finishes is one chance at its final length, and the ghost a later request resumes from is one
resumption at the ghost's length. Unlike the cache's own hits these counts do not depend on
what the eviction kept, so a learning eviction can weigh its leaves by them (on ShareGPT,
conversations end near the length at which the dataset split them: docs/admission.md,
session 28).

The branch point is always admitted (speculative insertion only finds real sharing). Bound:
at most ``1 + len(Kind)`` = 6 new states per request (branch + one per kind), usually 1-2.
A fingerprint is a hash of the whole prefix (``fingerprints``), so a ghost is credited only to
a request that shares that prefix: with a hash of the position and the 16 tokens before it,
the same conversation behind another system prompt of the same length (a benchmark's salted
rounds) credited its earlier copy's ghosts. A hash collision only skews the statistics, never
what a request is served (the tree checks tokens).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from marconi.cache.admission import (
    ADMISSION_POLICIES,
    LENGTH_BINS,
    AdmissionContext,
    AdmissionPolicy,
    _decode_multiples,
    length_bin,
)

_MOD = 1 << 64
_BASE = 0x9E3779B97F4A7C15  # odd, so invertible mod 2**64
_INV = pow(_BASE, -1, _MOD)
#: ``_BASE**j``, ``_INV**j`` and ``sum_{i <= j} _INV**i`` mod 2**64, j = 0, 1, ...; grown on demand
_tables = (np.ones(1, dtype=np.uint64),) * 3


class Kind(IntEnum):
    """Candidate positions a request proposes, besides the branch point."""

    RESEND = 0  # input_len - 1: where an identical prompt sent again resumes
    PROMPT_END = 1  # input_len: the next turn keeps the prompt but not the reply as fed
    ALIGNED_INPUT = 2  # the last block-aligned position of the input (block-granular reuse)
    DECODED = 3  # seq_len: the next turn extends exactly the tokens fed (the paper's bet)
    ALIGNED_DECODE = 4  # the last block-aligned position of the decoded part


_KINDS = tuple(Kind)


def _power_tables(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_tables``, at least ``n`` long."""
    global _tables
    if len(_tables[0]) < n:
        size = max(n, 2 * len(_tables[0]))
        steps = np.empty(size, dtype=np.uint64)
        steps[0] = 1
        steps[1:] = _BASE
        powers = np.cumprod(steps)  # numpy's uint64 arithmetic wraps mod 2**64, as wanted
        steps[1:] = _INV
        inv = np.cumprod(steps)
        _tables = (powers, inv, np.cumsum(inv))
    return _tables


class Fingerprints(NamedTuple):
    """What ``fingerprints`` returns."""

    values: list[int]  # the fingerprint at each asked position
    carry: int  # the token sum at the last position: ``fingerprints``' ``carry`` to go on from it


def fingerprints(
    tokens: np.ndarray | Sequence[int], positions: Sequence[int], start: int = 0, carry: int = 0
) -> Fingerprints:
    """The fingerprint of ``tokens[:p]`` for each ``p`` in ``positions`` (strictly increasing,
    each ``> start``): the polynomial hash ``h(p) = sum_{j < p} (t_j + 1) B^(p-1-j) mod 2**64``,
    read as ``B^(p-1)`` times the token sum ``sum_{j < p} t_j B^-j`` plus a table (the sum of
    ``B^-j``). One pass multiplies the tokens in ``[start, last position)`` (read in place as
    uint64 when they are 64-bit) and sums them between the positions; the tokens before
    ``start`` are not read: ``carry`` is their token sum (``Fingerprints.carry`` of an earlier
    call that ended at ``start`` on the same tokens; 0 with ``start`` 0)."""
    t = np.asarray(tokens)
    if t.dtype != np.int64 and t.dtype != np.uint64:
        t = t.astype(np.int64)
    t = t.view(np.uint64)  # int64 read as uint64: the same residue mod 2**64 as a cast, no copy
    powers, inv, inv_sums = _power_tables(positions[-1] if len(positions) else 0)
    if len(positions) <= 2:  # a decode's insert: per-call overhead dominates; dot products
        values = []
        for a, b in itertools.pairwise((start, *positions)):
            carry = (carry + int(t[a:b].dot(inv[a:b]))) % _MOD
            values.append(int(powers[b - 1]) * (carry + int(inv_sums[b - 1])) % _MOD)
        return Fingerprints(values, carry)
    pos = np.asarray(positions, dtype=np.intp)
    end = int(pos[-1])
    terms = np.multiply(t[start:end], inv[start:end])
    bounds = pos - start
    bounds[1:], bounds[0] = bounds[:-1].copy(), 0
    # the sum of each stretch between two positions, then up to each position (numpy's uint64
    # arithmetic wraps mod 2**64, as wanted); both much faster than a cumsum of all the terms
    sums = np.add.reduceat(terms, bounds).cumsum()
    i = pos - 1
    values = (powers[i] * (sums + inv_sums[i])).tolist()
    if carry:  # B^(p-1) (s + carry + ...) = the above + B^(p-1) carry
        values = [(v + pw * carry) % _MOD for v, pw in zip(values, powers[i].tolist(), strict=True)]
    return Fingerprints(values, (int(sums[-1]) + carry) % _MOD)


class _PromptSum(NamedTuple):
    """``observe_prefill``'s memo: the token sum of a request's whole input, from which
    ``observe_insert`` fingerprints the decoded part without reading the input again."""

    length: int
    carry: int


def _aligned(block: int, lo: int, hi: int) -> int | None:
    """The largest multiple of ``block`` in ``(lo, hi]``, if any."""
    last = hi - hi % block
    return last if last > lo else None


class GhostTable:
    """Bounded FIFO of ghost entries: fingerprint -> (position, bitmask of kinds)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[int, list[int]] = {}  # fingerprint -> [position, mask]
        self._order: deque[int] = deque()
        self._count: dict[int, int] = {}  # position -> entries there
        self._positions: list[int] = []  # the distinct positions, sorted

    def add(self, fp: int, pos: int, kind: Kind) -> None:
        entry = self.entries.get(fp)
        if entry is not None:
            entry[1] |= 1 << kind
            return
        self.entries[fp] = [pos, 1 << kind]
        self._order.append(fp)
        if self._count.setdefault(pos, 0) == 0:
            bisect.insort(self._positions, pos)
        self._count[pos] += 1
        if len(self.entries) > self.capacity:
            old_pos, _ = self.entries.pop(self._order.popleft())
            self._count[old_pos] -= 1
            if not self._count[old_pos]:
                del self._count[old_pos]
                del self._positions[bisect.bisect_left(self._positions, old_pos)]

    def tried(self, lo: int, hi: int, tries: int) -> list[int]:
        """The positions ``deepest`` looks at in ``[lo, hi]``: the ``tries`` deepest that
        hold a ghost, ascending."""
        i = bisect.bisect_right(self._positions, hi)
        j = max(bisect.bisect_left(self._positions, max(lo, 1)), i - tries)
        return self._positions[j:i]

    def deepest(self, positions: list[int], fps: dict[int, int]) -> tuple[int, int] | None:
        """The deepest ghost ``(position, mask)`` among ``positions`` (from ``tried``) on the
        tokens whose fingerprint at each position is ``fps[position]``."""
        for pos in reversed(positions):
            entry = self.entries.get(fps[pos])
            if entry is not None and entry[0] == pos:
                return pos, entry[1]
        return None


@ADMISSION_POLICIES.register("learned")
class GhostAdmission(AdmissionPolicy):
    """Branch point + the candidate kinds whose ghosts show reuse (see the module doc)."""

    name = "learned"
    learns = True
    #: admitted before any ghost has been credited: the paper's last decoded token (a next turn
    #: that extends the fed tokens exactly) and the state one token before the prompt end (an
    #: identical prompt sent again resumes from all but its last token; a next turn that
    #: re-renders the reply resumes from the prompt), so a fresh server's second turn hits
    PRIOR = (Kind.RESEND, Kind.DECODED)

    def __init__(
        self,
        block: int = 512,
        threshold: float = 0.2,
        ghosts: int = 8192,
        half_life: int = 1024,
        tries: int = 32,
        length_prior: float = 32.0,
        by_length: bool = True,
    ) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block, self.threshold, self.tries, self.half_life = block, threshold, tries, half_life
        self.ghosts = GhostTable(ghosts)
        self.proposals = np.zeros(len(Kind))
        self.credit = np.zeros(len(Kind))
        self.enabled = set(self.PRIOR)
        self._events = 0
        #: per ``length_bin``: requests that ended there, and later requests resumed there
        self.ended = np.zeros(LENGTH_BINS)
        self.resumed = np.zeros(LENGTH_BINS)
        #: pseudo-requests at the pooled rate that each bin's rate is shrunk towards
        self.length_prior = length_prior
        self.by_length = by_length  # False: offer no ``reuse_by_length`` (A/B runs)

    # -------------------------------------------------------------- learning
    def observe_prefill(self, tokens: np.ndarray, key_len: int, usable_len: int) -> object:
        n = len(tokens)
        proposals = (
            (Kind.RESEND, n - 1 if n > 1 else None),
            (Kind.PROMPT_END, n),
            (Kind.ALIGNED_INPUT, _aligned(self.block, 0, n)),
        )
        tried = self.ghosts.tried(usable_len, min(key_len, n), self.tries)
        wanted = sorted({*tried, *(p for _, p in proposals if p)})
        found = fingerprints(tokens, wanted)
        fps = dict(zip(wanted, found.values, strict=True))
        hit = self.ghosts.deepest(tried, fps)
        if hit is not None:
            pos, mask = hit
            self.resumed[length_bin(pos)] += 1
            for k in Kind:
                if mask >> k & 1:
                    self.credit[k] += pos
        for kind, pos in proposals:
            self._propose(kind, pos, fps)
        self._update()
        return _PromptSum(n, found.carry) if n else None

    def observe_insert(self, tokens: np.ndarray, input_len: int, memo: object = None) -> None:
        n = len(tokens)
        self.ended[length_bin(max(n, input_len))] += 1
        if n <= input_len:
            return
        proposals = ((Kind.DECODED, n), (Kind.ALIGNED_DECODE, _aligned(self.block, input_len, n)))
        wanted = sorted({p for _, p in proposals if p})
        if isinstance(memo, _PromptSum) and memo.length == input_len:
            found = fingerprints(tokens, wanted, input_len, memo.carry)  # the output only
        else:
            found = fingerprints(tokens, wanted)
        fps = dict(zip(wanted, found.values, strict=True))
        for kind, pos in proposals:
            self._propose(kind, pos, fps)

    def _propose(self, kind: Kind, pos: int | None, fps: dict[int, int]) -> None:
        if not pos:
            return
        self.proposals[kind] += 1
        self.ghosts.add(fps[pos], pos, kind)

    def _update(self) -> None:
        self._events += 1
        if self._events % self.half_life == 0:
            self.proposals *= 0.5
            self.credit *= 0.5
            self.ended *= 0.5
            self.resumed *= 0.5
        credit = self.credit.tolist()  # five numbers: plain floats are faster than numpy's
        if not any(credit):
            return
        yields = [c / max(p, 1.0) for c, p in zip(credit, self.proposals.tolist(), strict=True)]
        bar = self.threshold * max(yields)
        self.enabled = {k for k, y in zip(_KINDS, yields, strict=True) if y > 0 and y >= bar}

    @property
    def block_granular(self) -> bool:
        return Kind.ALIGNED_INPUT in self.enabled

    def reuse_by_length(self) -> list[float] | None:
        ended = self.ended.sum()
        rate = self.resumed.sum() / ended if ended else 0.0
        if not (rate and self.by_length):
            return None
        # a resumption can land a bin below the request's end (a prompt-end ghost): cap at 1
        own = (np.minimum(self.resumed, self.ended) + self.length_prior * rate) / (
            self.ended + self.length_prior
        )
        return (own / rate).tolist()

    def yields(self) -> dict[str, float]:
        """Credited tokens per proposal, per kind (for reports)."""
        y = self.credit / np.maximum(self.proposals, 1.0)
        return {k.name.lower(): float(y[k]) for k in Kind}

    def learned(self) -> dict[str, object]:
        return {
            "admitted": sorted(k.name.lower() for k in self.enabled),
            "yields": {k: round(v, 1) for k, v in self.yields().items()},
        }

    # -------------------------------------------------------------- decisions
    def prefill_positions(self, ctx: AdmissionContext) -> tuple[int, ...]:
        n, lo = ctx.input_len, ctx.usable_len
        picks = {
            Kind.RESEND: n - 1,
            Kind.PROMPT_END: n,
            Kind.ALIGNED_INPUT: _aligned(self.block, lo, n),
        }
        out = set(self._branch(ctx))
        out.update(p for k, p in picks.items() if k in self.enabled and p is not None and p > lo)
        return tuple(sorted(out))

    def decode_positions(self, input_len: int, seq_len: int) -> tuple[int, ...]:
        if seq_len <= input_len:
            return ()
        out = set()
        if Kind.DECODED in self.enabled:
            out.add(seq_len)
        if Kind.ALIGNED_DECODE in self.enabled:
            aligned = _aligned(self.block, input_len, seq_len)
            if aligned is not None:
                out.add(aligned)
        return tuple(sorted(out))

    def capture_points(self, input_len: int, lo: int, hi: int) -> tuple[int, ...]:
        if Kind.ALIGNED_DECODE not in self.enabled:
            return ()  # the decoded state is the working one (no copy during decode)
        return _decode_multiples(self.block, input_len, lo, hi)

"""Eviction that learns reuse from the cache's own hits: hit density per candidate class.

After LHD (Beckmann et al., NSDI 2018): a candidate's worth is its *hit density*, the hits it
can still expect per unit of time it will occupy the cache, times what a hit saves per byte it
holds. Both the hit probability and the remaining lifetime are read off per-class age
histograms that the cache fills online: every hit and every eviction is recorded at the age
(clock ticks since the node's last access) it happened. Between LRU (age only, one class) and
Belady (knows the next use): a state that chat traffic has already continued past (an inner
node hit once) learns to go first; a conversation tip learns the think-time distribution of
its workload, so under thrashing the cache keeps a stable subset of sessions instead of
evicting every tip just before its next turn.

What a hit saves grows with the prefix, which the density alone does not count: past
``long_prefix`` tokens a candidate's density is multiplied by ``tokens / long_prefix``, so
every shorter prefix is ranked as before and a 60k-token agent context is not evicted like a
chat tip (SWE-bench sessions of 30-60k tokens decided the SWE cells: docs/admission.md,
session 26).

Which conversations have ended is what separates the cache from Belady on chat traffic
(docs/admission.md, sessions 17 and 28), and the admission's ghosts see it uncensored: a
leaf's density is multiplied by how much likelier than average a request that ended at its
length is to be resumed (``AdmissionPolicy.reuse_by_length``, adopted at each refit; not on
block-granular reuse, whose leaves are not where requests ended).

Classes (``kind``): leaf or inner node x hits so far (0, 1, 2, 3+). The histograms decay by
half every ``half_life`` events so the policy follows workload shifts.

Block-granular reuse (the admission policy has learned that requests resume from block-aligned
positions of earlier inputs, as Mooncake's do): every request is its own session and a state is
reused a median ~325 requests after it was admitted, so (1) the class densities are shrunk harder
towards the pooled one (``block_prior``: few lifetimes per class end in a hit), (2) a candidate's
density is divided by ``bytes_freed ** block_size_penalty`` (LHD's own density is per byte; a mild
power of it), and (3) alpha is held at 0 (``alpha_hold``): the tuner's 64-request windows are
shorter than the reuse distance, so their scores are noise and its switches lose. Measured in
docs/admission.md (session 18).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from marconi.cache.admission import length_bin
from marconi.cache.eviction import EVICTION_POLICIES, CandidateInfo, EvictionPolicy

if TYPE_CHECKING:
    from marconi.cache.admission import AdmissionPolicy
    from marconi.cache.node import Node

_HIT_BUCKETS = 4
KINDS = 2 * _HIT_BUCKETS
_BINS_PER_OCTAVE = 4
_BINS = 4 * 40  # ages up to 2^40 ticks


def _age_bin(age: int | np.ndarray) -> np.ndarray:
    """Log-spaced age bins (4 per doubling)."""
    a = np.maximum(np.asarray(age, dtype=np.float64), 0.0)
    return np.minimum((np.log2(a + 1.0) * _BINS_PER_OCTAVE).astype(np.int64), _BINS - 1)


def _bin_of(age: int) -> int:
    """``_age_bin`` of one age (scalar, no numpy overhead)."""
    return min(int(math.log2(max(age, 0) + 1.0) * _BINS_PER_OCTAVE), _BINS - 1)


#: a representative age per bin (its lower edge)
_BIN_AGE = 2.0 ** (np.arange(_BINS) / _BINS_PER_OCTAVE) - 1.0


def class_of(is_leaf: bool, hits: int) -> int:
    """A candidate's class: leaf or inner, times its hit count bucket (0, 1, 2, 3+)."""
    return (_HIT_BUCKETS if is_leaf else 0) + min(hits, _HIT_BUCKETS - 1)


def candidate_kind(node: Node) -> int:
    """``class_of`` a tree node."""
    return class_of(not node.children, node.hits)


def hit_density(hits: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Hit density at each age bin from histograms of lifetimes ending in a hit (``hits``)
    and all lifetimes (``ends``, hits + evictions): expected further hits over expected
    remaining ticks, ``sum_{x>=a} H(x) / sum_{x>=a} N(x) (x - a + 1)``. Rows of 2-D
    histograms are independent classes (one call for all of them)."""
    s_hits = np.cumsum(hits[..., ::-1], axis=-1)[..., ::-1]
    s0 = np.cumsum(ends[..., ::-1], axis=-1)[..., ::-1]
    s1 = np.cumsum((ends * _BIN_AGE)[..., ::-1], axis=-1)[..., ::-1]
    life = s1 - _BIN_AGE * s0 + s0
    return np.divide(s_hits, life, out=np.zeros_like(s_hits), where=life > 0)


@EVICTION_POLICIES.register("hit-density")
class HitDensity(EvictionPolicy):
    """Evict the lowest ``hit_density(kind, age) * tokens ** alpha`` (``tokens``: the prefix
    a hit on the node gives; ``alpha`` weighs what a hit saves against how likely it is,
    tuned online over ``alpha_grid`` like the FLOP-aware weight), times
    ``tokens / long_prefix`` past ``long_prefix`` tokens, times (leaves) the admission's
    ``reuse_by_length`` at the leaf's length; a candidate that cannot be hit (a
    leaf without a state in a hybrid model) goes first. A class's density is shrunk towards the
    pooled density of all classes with weight ``prior / (prior + its lifetimes)``; with
    nothing recorded yet it is LRU (density ``1 / (age + 1)``). Priorities change with age,
    so the index refits when the clock has moved by a tenth of the candidates' age span
    (``stale``)."""

    name = "hit-density"
    single_child = True
    needs_fit = True
    needs_cost = False
    learns = True
    refit_fraction = 0.125
    has_alpha = True
    alpha_grid = (0.0, 0.5, 1.0)
    #: a shadow that wins one window often loses the next: switch on steadier evidence, two
    #: windows in a row, unless one window's lead is decisive (session 43, docs/admission.md)
    tuner_hints: ClassVar[dict[str, float]] = {
        "patience": 2,
        "margin": 0.01,
        "decisive": 0.025,
        "decay": 0.9,
    }

    def __init__(
        self,
        alpha: float = 0.0,
        half_life: int = 2048,
        prior: float = 32.0,
        block_prior: float = 256.0,
        block_size_penalty: float = 0.1,
        long_prefix: int = 16384,
    ) -> None:
        self.alpha = float(alpha)
        #: prefix length (tokens) from which a hit's worth scales the density (not on
        #: block-granular reuse, whose long prefixes are mostly never reused)
        self.long_prefix = long_prefix
        self.half_life = half_life
        self.prior = prior
        self.block_prior = block_prior
        self.block_size_penalty = block_size_penalty
        #: the admission policy has learned block-granular reuse (``observe_admission``)
        self.block_granular = False
        self.hits = np.zeros((KINDS, _BINS))
        self.ends = np.zeros((KINDS, _BINS))
        self.events = 0
        self.now = 0
        self._fit_now = self._span = 0
        self._rows = np.tile(1.0 / (_BIN_AGE + 1.0), (KINDS, 1)).tolist()
        #: the admission's latest ``reuse_by_length``, and the one adopted at the last fit
        self._length_seen: list[float] | None = None
        self._length: list[float] | None = None

    def kind(self, node: Node) -> int:
        return candidate_kind(node)

    def observe_admission(self, admission: AdmissionPolicy) -> None:
        self.block_granular = admission.block_granular
        self._length_seen = None if self.block_granular else admission.reuse_by_length()

    @property
    def alpha_hold(self) -> float | None:
        return 0.0 if self.block_granular else None

    def record(self, info: CandidateInfo, now: int, hit: bool) -> None:
        self.now = max(self.now, now)
        if not info.tokens:
            return  # nothing a hit could use (a leaf without a state): not a lifetime
        b = _bin_of(now - info.last_access)
        self.ends[info.kind, b] += 1
        if hit:
            self.hits[info.kind, b] += 1
        self.events += 1
        if self.events % self.half_life == 0:
            self.hits *= 0.5
            self.ends *= 0.5

    def stale(self, now: int) -> bool:
        return now - self._fit_now > max(16, self._span // 10)

    def fit(self, infos: Sequence[CandidateInfo]) -> None:
        if infos:
            accessed = [i.last_access for i in infos]
            self.now = max(self.now, max(accessed))
            self._span = self.now - min(accessed)
        self._fit_now = self.now
        self._length = self._length_seen  # None on block-granular reuse (observe_admission)
        if not self.ends.any():
            return
        pooled = hit_density(self.hits.sum(0), self.ends.sum(0))
        own = hit_density(self.hits, self.ends)
        n = self.ends.sum(1)[:, None]
        prior = self.block_prior if self.block_granular else self.prior
        self._rows = ((n * own + prior * pooled) / (n + prior)).tolist()

    def density(self, kind: int, age: int) -> float:
        """The fitted hit density of class ``kind`` at ``age`` ticks."""
        return float(self._rows[kind][_bin_of(age)])

    def priority(self, info: CandidateInfo) -> float:
        if not info.tokens:
            return -1.0
        density = self._rows[info.kind][_bin_of(self.now - info.last_access)]
        if self.block_granular:
            if info.bytes_freed:
                density /= info.bytes_freed**self.block_size_penalty
        else:
            if info.tokens > self.long_prefix:
                density *= info.tokens / self.long_prefix
            if self._length is not None and info.kind >= _HIT_BUCKETS:  # a leaf
                density *= self._length[length_bin(info.tokens)]
        return density * info.tokens**self.alpha if self.alpha else density

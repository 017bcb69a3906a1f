"""Alpha tuning for FLOP-aware eviction: what-if replays of recent requests on cache snapshots.

Both tuners are fed every request (``observe``) and replay requests through copies of the cache
with each alpha of a grid. The replay is ``replay_fed`` (below): ``(input ids, fed tokens)``
pairs driven through ``marconi.cache.lease.Leases``, the lifecycle the engine, the simulator and
the SGLang backend's tuner all run, so a what-if replay counts hits exactly as the live cache does.

- ``PaperTuner`` (the paper's method, our baseline): alpha = 0 until the first eviction; then
  snapshot the cache, record the next 5x as many requests as were seen so far, replay that window
  for every alpha (in parallel processes) and keep the best alpha for good.
- ``ShadowTuner`` (ours): a shadow cache per alpha runs alongside on the live requests; the real
  cache follows the shadow with the best recent (decayed) hit score. It keeps adapting when the
  workload shifts, and since each shadow runs its alpha for real (not a short what-if from the
  current contents), it tracks the best fixed alpha in hindsight.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, ClassVar

import numpy as np

from marconi.cache.eviction import EvictionPolicy
from marconi.cache.lease import Leases
from marconi.cache.prefix_cache import PrefixCache, clone_cache
from marconi.registry import Registry

#: replay(cache_clone, requests) -> score (higher is better; ``replay_fed`` returns hit tokens)
ReplayFn = Callable[[PrefixCache, Sequence[Any]], float]
#: what the tuners observe and replay: (input ids, tokens fed to the model = input + output[:-1])
FedRequest = tuple[np.ndarray, np.ndarray]


def replay_fed(cache: PrefixCache, items: Sequence[FedRequest]) -> int:
    """Hit tokens of replaying finished requests sequentially through ``cache`` with the live
    lifecycle (``Leases.replay``: same match rule, captures and insertion as the engine)."""
    leases = Leases(cache)
    hits = 0
    for input_ids, fed in items:
        lease = leases.replay(input_ids, fed)
        hits += 0 if lease is None else lease.prefix_len
    return hits


DEFAULT_GRID = EvictionPolicy.alpha_grid  # FLOP-aware; a policy may declare its own

_JOB: tuple[PrefixCache, Sequence[Any], ReplayFn] | None = None  # inherited by forked workers


def _score_one(alpha: float) -> float:
    assert _JOB is not None
    snapshot, window, replay = _JOB
    trial = clone_cache(snapshot)
    trial.set_alpha(alpha)
    return float(replay(trial, window))


def evaluate_grid(
    snapshot: PrefixCache,
    window: Sequence[Any],
    grid: Sequence[float],
    replay: ReplayFn,
    workers: int = 0,
) -> list[float]:
    """Score of replaying ``window`` from ``snapshot`` for each alpha of ``grid``. Runs in forked
    worker processes when ``workers > 1`` (the snapshot is shared copy-on-write, never pickled)."""
    global _JOB
    _JOB = (snapshot, window, replay)
    try:
        workers = workers or min(len(grid), os.cpu_count() or 1)
        if workers <= 1 or len(window) < 32 or "fork" not in mp.get_all_start_methods():
            return [_score_one(a) for a in grid]
        ctx = mp.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            return list(pool.map(_score_one, grid))
    finally:
        _JOB = None


class AlphaTuner(ABC):
    """Chooses the FLOP-aware alpha of ``cache`` online. Contract: ``observe`` is called once per
    request, before it is served; it may change ``cache``'s alpha and nothing else."""

    name: str

    def __init__(
        self,
        cache: PrefixCache,
        replay: ReplayFn = replay_fed,
        grid: Sequence[float] | None = None,
        workers: int = 0,
    ) -> None:
        if cache.alpha is None:
            raise ValueError("alpha tuning needs an eviction policy with an alpha")
        self.cache = cache
        self.replay = replay
        self.grid = tuple(grid if grid is not None else cache.eviction.alpha_grid)
        self.workers = workers
        self.history: list[tuple[int, float]] = [(0, float(cache.alpha))]
        self.tuning_s = 0.0
        self.seen = 0

    def _evicted(self) -> bool:
        s = self.cache.stats
        return bool(s.evicted_nodes or s.evicted_states)

    def _scores(self, snapshot: PrefixCache, window: Sequence[Any]) -> list[float]:
        t = time.perf_counter()
        scores = evaluate_grid(snapshot, window, self.grid, self.replay, self.workers)
        self.tuning_s += time.perf_counter() - t
        return scores

    def _set(self, alpha: float) -> None:
        if alpha != self.cache.alpha:
            self.cache.set_alpha(alpha)
            self.history.append((self.seen, alpha))

    @abstractmethod
    def observe(self, request: Any) -> None: ...


TUNERS: Registry[AlphaTuner] = Registry("alpha tuner")


@TUNERS.register("paper")
class PaperTuner(AlphaTuner):
    """The paper's bootstrap: tune once, on a window of 5x the requests before the first
    eviction, then keep that alpha."""

    name = "paper"

    def __init__(self, *args: Any, window_factor: int = 5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.window_factor = window_factor
        self._snapshot: PrefixCache | None = None
        self._window: list[Any] = []
        self._target = 0
        self.done = False

    def observe(self, request: Any) -> None:
        self.seen += 1
        if self.done:
            return
        if self._snapshot is None:
            if self._evicted():
                self._snapshot = clone_cache(self.cache)
                self._target = self.window_factor * (self.seen - 1)
            else:
                return
        self._window.append(request)
        if len(self._window) >= max(self._target, 1):
            scores = self._scores(self._snapshot, self._window)
            self._set(self.grid[max(range(len(scores)), key=lambda i: (scores[i], -i))])
            self._snapshot, self._window, self.done = None, [], True


@TUNERS.register("shadow")
class ShadowTuner(AlphaTuner):
    """Ours: one shadow cache per alpha of the grid (same budget, byte counts only) is fed every
    request; every ``window`` requests, the real cache switches to the alpha whose shadow has the
    best hit score, decayed by ``decay`` per window, once it has beaten the current alpha's
    shadow by ``margin`` (a fraction) for ``patience`` windows in a row, or at once when it leads
    by ``decisive`` (a fraction; infinite by default). An eviction policy may
    set its own defaults (``tuner_hints``); while its ``alpha_hold`` is set, the real cache keeps
    that alpha and the shadows keep running. Each shadow measures its alpha's long-run behaviour
    on the live workload (not a short what-if from the current contents), so the choice tracks
    the best fixed alpha in hindsight and follows the workload when it shifts.

    Each request is replayed on the shadows as it is observed, not a window at a time: the same
    replays in the same order (so the same decisions), but a server's engine thread pays ~1 ms
    per finished request instead of a ~100 ms stall every ``window`` requests (tiny, 256 MB),
    which landed on whichever request was in flight."""

    name = "shadow"

    #: settings when neither the caller nor the eviction policy (``tuner_hints``) gives them
    DEFAULTS: ClassVar[dict[str, float]] = {
        "window": 64,
        "decay": 0.8,
        "margin": 0.005,
        "patience": 1,
        "decisive": math.inf,
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        opts = {k: kwargs.pop(k) for k in list(kwargs) if k in self.DEFAULTS}
        super().__init__(*args, **kwargs)
        hints = getattr(self.cache.eviction, "tuner_hints", {})
        cfg = {**self.DEFAULTS, **hints, **opts}
        self.window, self.patience = int(cfg["window"]), int(cfg["patience"])
        self.decay, self.margin = float(cfg["decay"]), float(cfg["margin"])
        self.decisive = float(cfg["decisive"])
        self._leads: tuple[int, int] = (-1, 0)  # (index of the leading alpha, windows in a row)
        self.shadows = []
        for alpha in self.grid:
            shadow = clone_cache(self.cache)
            shadow.set_alpha(alpha)
            self.shadows.append(shadow)
        self.totals = [0.0] * len(self.grid)
        self._scores = [0.0] * len(self.grid)  # this window's, so far

    def observe(self, request: Any) -> None:
        self.seen += 1
        t = time.perf_counter()
        for i, shadow in enumerate(self.shadows):
            self._scores[i] += self.replay(shadow, (request,))
        self.tuning_s += time.perf_counter() - t
        if self.seen % self.window:
            return
        scores, self._scores = self._scores, [0.0] * len(self.grid)
        self.totals = [self.decay * t + s for t, s in zip(self.totals, scores, strict=True)]
        hold = self.cache.eviction.alpha_hold
        if hold is not None:  # the policy keeps its alpha for now; the shadows keep learning
            self._set(hold)
            self._leads = (-1, 0)
            return
        cur = self.grid.index(self.cache.alpha) if self.cache.alpha in self.grid else 0
        best = max(range(len(self.grid)), key=lambda i: (self.totals[i], -i))
        if self.totals[best] > self.totals[cur] * (1 + self.margin):
            lead, n = self._leads
            self._leads = (best, n + 1 if lead == best else 1)
            decisive = self.totals[best] > self.totals[cur] * (1 + self.decisive)
            if self._leads[1] >= self.patience or decisive:
                self._set(self.grid[best])
        else:
            self._leads = (-1, 0)

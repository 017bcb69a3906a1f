"""Online alpha tuning for the SGLang backend (``--marconi-alpha auto``, the default).

The same tuner as Marconi's own engine (``marconi.cache.tuning.ShadowTuner`` with
``marconi.cache.tuning.replay_fed``, one process, replaying with SGLang's match rule
``names.SGLANG_MATCH_RULE``): one shadow ``PrefixCache`` per alpha of the grid
(byte counts only, no tensors) is fed every finished request; every ``window`` requests the
reference cache takes the alpha whose shadow had the best decayed hit score. ``BackendAlphaTuner``
builds that reference cache for an SGLang deployment and copies its alpha into the backend's
``MarconiPolicy`` after each observation.

Reference cache: the served model's cost model, the ``marconi`` preset config (SGLang's page
size) and a shared byte budget equal to SGLang's two pools, counted in the cost model's bytes:
``kv_slots * kv_bytes_per_token + state_slots * state_bytes``. With one GPU and the model's dtype
that is exactly the pools' bytes; under tensor parallelism (a rank holds 1/tp of every slot) it
still gives the shadows as many KV tokens and states as SGLang's pools hold, which is what the
eviction pressure depends on. Each rank tunes on the same finished requests, so all ranks pick
the same alpha.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from marconi.cache.pools import MemoryBudget
from marconi.cache.prefix_cache import PrefixCache
from marconi.cache.presets import preset_config
from marconi.cache.tuning import ShadowTuner, replay_fed
from marconi.integrations.sglang.names import SGLANG_MATCH_RULE
from marconi.integrations.sglang.policy import MarconiPolicy

logger = logging.getLogger(__name__)

#: ``--marconi-alpha auto`` starts here (LRU order over Marconi's candidates, as the engine's).
AUTO_ALPHA_START = 0.0
#: Finished requests between two alpha decisions (``ShadowTuner``'s default).
DEFAULT_WINDOW = 64


class BackendAlphaTuner:
    """Feeds a ``ShadowTuner`` with finished requests and keeps ``policy``'s alpha equal to the
    tuner's reference cache's. ``kv_slots``/``state_slots``: SGLang's KV-pool tokens and Mamba
    pool slots (the shadows' budget)."""

    def __init__(
        self,
        policy: MarconiPolicy,
        kv_slots: int,
        state_slots: int,
        page_size: int = 1,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        cost = policy.cost
        self.policy = policy
        self.budget_bytes = int(kv_slots) * cost.kv_bytes_per_token + int(state_slots) * int(
            cost.state_bytes
        )
        config = preset_config(
            policy.preset, alpha=policy.alpha, page_size=page_size, match_rule=SGLANG_MATCH_RULE
        )
        self.reference = PrefixCache(cost, MemoryBudget.shared(self.budget_bytes), config)
        self.tuner = ShadowTuner(self.reference, replay=replay_fed, workers=1, window=window)
        logger.info(
            "marconi: alpha tuning on (shadow caches, grid=%s, window=%d, budget=%d B = %d KV "
            "tokens + %d states)",
            ",".join(f"{a:g}" for a in self.tuner.grid),
            window,
            self.budget_bytes,
            kv_slots,
            state_slots,
        )

    @property
    def history(self) -> list[tuple[int, float]]:
        """``(finished requests seen, alpha)`` at the start and at every change."""
        return self.tuner.history

    def observe(self, input_ids: Sequence[int], fed_tokens: Sequence[int]) -> float | None:
        """One finished request: its prompt and the tokens whose KV/state it computed
        (prompt + output[:-1]). Returns the new alpha when it changed, else None."""
        fed = np.asarray(fed_tokens, dtype=np.int64)
        inp = np.asarray(input_ids, dtype=np.int64)[: len(fed)]
        self.tuner.observe((inp, fed))
        alpha = float(self.reference.alpha or 0.0)
        if alpha == self.policy.alpha:
            return None
        old = self.policy.alpha
        self.policy.set_alpha(alpha)
        logger.info(
            "marconi: alpha %g -> %g after %d finished requests (shadow hit scores: %s)",
            old,
            alpha,
            self.tuner.seen,
            " ".join(
                f"{a:g}:{s:.0f}" for a, s in zip(self.tuner.grid, self.tuner.totals, strict=True)
            ),
        )
        return alpha

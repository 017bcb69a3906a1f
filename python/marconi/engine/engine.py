"""``Engine``: model + prefix cache + scheduler, stepped synchronously.

``step()`` is the whole control loop: schedule -> run -> postprocess. ``LLM`` (offline) calls it
until every request is done; ``AsyncEngine`` (server) calls it from a background thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from marconi.cache.cost import cost_model_from_hf_config
from marconi.cache.lease import Leases, NoReuse
from marconi.cache.pools import MemoryBudget
from marconi.cache.prefix_cache import CacheStats, PrefixCache
from marconi.cache.presets import preset_config
from marconi.cache.tuning import AlphaTuner, ShadowTuner, replay_fed
from marconi.engine.cache_manager import CacheManager
from marconi.engine.config import ConfigError, EngineConfig
from marconi.engine.request import Detokenizer, Req, SamplingParams, StepOutput
from marconi.engine.runner import ModelRunner, size_onednn_cache
from marconi.engine.schedule_policy import SCHEDULE_POLICIES
from marconi.engine.scheduler import Scheduler
from marconi.models.loader import load_model, resolve_model_path
from marconi.models.memory import HybridMemory, torch_dtype
from marconi.models.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from marconi.cache.node import SizeInfo

log = logging.getLogger("marconi.engine")


class RequestError(ValueError):
    """A request the engine can never serve (prompt too long, empty, ...): a client error.
    ``code`` is an OpenAI-style error code."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


class StepTimes(NamedTuple):
    """Seconds the engine thread has spent in each phase of ``Engine.step`` since start:
    ``forward`` is the model, ``sample`` turns logits into tokens, ``postprocess`` is the
    token bookkeeping, cache admission, the tuner and the integrity check. On a GPU the
    forward's kernels finish in ``sample`` (its first synchronisation)."""

    schedule: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    postprocess: float = 0.0


_SCHEDULE, _FORWARD, _SAMPLE, _POSTPROCESS = range(len(StepTimes._fields))


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot (taken on the engine thread) for metrics and debugging."""

    running: int
    waiting: int
    requests_finished: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    steps: int
    step_times: StepTimes
    size: SizeInfo
    cache: CacheStats
    kv_bytes_per_slot: int
    state_bytes_per_slot: int
    alpha: float | None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def kv_bytes_in_use(self) -> int:
        s = self.size
        return (s.kv_total - s.kv_free) * self.kv_bytes_per_slot

    @property
    def state_bytes_in_use(self) -> int:
        s = self.size
        return (s.state_total - s.state_free) * self.state_bytes_per_slot


class Engine:
    """Serves generation requests for one model with one prefix cache (see ``EngineConfig``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.setup = config.resolve_cache()  # before the weights: a budget error comes at once
        path = resolve_model_path(config.model)
        self.model_path = path
        self.model = load_model(path, torch_dtype(config.dtype), config.device)
        self.tokenizer = load_tokenizer(path)
        hf = self.model.config.hf
        self.context_length = config.context_length or int(
            hf.get("max_position_embeddings") or 8192
        )
        self.cache, self.memory = self._build_cache(hf)
        self.tuner = self._build_tuner()
        on_finish = None if self.tuner is None else self._observe
        protocol = Leases if self.setup.reuse else NoReuse
        self.manager = CacheManager(protocol(self.cache, on_finish), self.memory)
        self.runner = ModelRunner(self.model, self.memory, seed=config.seed)
        size_onednn_cache(self.model, config.max_running_requests + config.chunked_prefill_size)
        self.scheduler = Scheduler(
            self.manager,
            self.tokenizer,
            config.max_running_requests,
            config.chunked_prefill_size,
            SCHEDULE_POLICIES.create(config.schedule_policy),
            config.queue_timeout,
        )
        self._ids = itertools.count()
        self.requests_finished = self.prompt_tokens = self.cached_tokens = 0
        self.generated_tokens = self.steps = 0
        self._phase_s = list(StepTimes())

    def _build_cache(self, hf: dict) -> tuple[PrefixCache, HybridMemory]:
        """A cache whose byte accounting is the layer specs' in the served dtypes, and a memory
        with exactly as many KV and state slots as the cache's pools (and the same bytes)."""
        dtypes = self.model.cache_dtypes()
        cost = cost_model_from_hf_config(
            hf, name=self.model_path.name, dtype=dtypes.kv, ssm_state_dtype=dtypes.ssm
        )
        setup = self.setup
        cache_cfg = preset_config(setup.preset, alpha=setup.alpha)
        cache = PrefixCache(cost, MemoryBudget.shared(setup.nbytes), cache_cfg)
        kv, st = cache.pools.kv, cache.pools.state
        if kv is None or st is None:
            raise NotImplementedError("the engine serves hybrid models (attention + SSM) only")
        if not (kv.num_slots and st.num_slots):
            raise ConfigError(
                f"--cache-memory {self.config.cache_memory} is too small for"
                f" {self.model_path.name}: one SSM state takes {cost.state_bytes:,} bytes and"
                f" each token's KV {cost.kv_bytes_per_token:,}"
            )
        try:
            memory = self.model.allocate_memory(kv.num_slots * kv.page_size, st.num_slots, dtypes)
        except RuntimeError as e:  # the allocator's out-of-memory
            raise ConfigError(
                f"could not allocate the cache (--cache-memory {self.config.cache_memory}): {e}"
            ) from e
        counted = (cost.kv_bytes_per_token, cost.state_bytes)
        if (memory.kv_bytes_per_slot, memory.state_bytes_per_slot) != counted:
            raise AssertionError(f"layer specs {counted} != allocated {memory.spec}")
        return cache, memory

    def _build_tuner(self) -> AlphaTuner | None:
        """``--alpha auto`` on a preset that tunes: shadow caches (byte counts only) fed with
        every finished request choose the FLOP-aware weight online (``marconi.cache.tuning``)."""
        if not self.setup.tune_alpha:
            return None
        return ShadowTuner(self.cache, replay=replay_fed, workers=1)

    def _observe(self, input_ids: np.ndarray, fed_tokens: np.ndarray) -> None:
        assert self.tuner is not None
        self.tuner.observe((input_ids, fed_tokens))

    # ------------------------------------------------------------------ requests
    def make_request(
        self, prompt_ids: list[int] | np.ndarray, params: SamplingParams, rid: str | None = None
    ) -> Req:
        """Validate and build a request (does not queue it). Raises ``RequestError``."""
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            raise RequestError("the prompt is empty", "empty_prompt", "prompt")
        vocab = self.runner.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise RequestError(f"token ids must be in [0, {vocab})", "invalid_token", "prompt")
        room = self.context_length - len(ids)
        if room < 1:
            raise RequestError(
                f"this model's maximum context length is {self.context_length} tokens, "
                f"but the prompt has {len(ids)} tokens",
                "context_length_exceeded",
                "messages",
            )
        max_new = params.max_tokens or min(self.config.default_max_tokens, room)
        if max_new > room:
            raise RequestError(
                f"max_tokens ({max_new}) + prompt ({len(ids)} tokens) exceeds this model's "
                f"maximum context length of {self.context_length} tokens",
                "context_length_exceeded",
                "max_tokens",
            )
        if not self.manager.fits_empty(len(ids) + max_new):
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) does not fit in the cache "
                f"memory ({self.config.cache_memory}); lower max_tokens or raise --cache-memory",
                "context_length_exceeded",
                "max_tokens",
            )
        req = Req(rid or f"req-{next(self._ids)}", ids, params, max_new_tokens=max_new)
        req.detok = Detokenizer(self.tokenizer, params.stop)
        return req

    def add_request(self, req: Req) -> None:
        self.scheduler.add(req)

    def abort(self, rid: str, reason: str = "abort") -> StepOutput | None:
        return self.scheduler.abort(rid, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[StepOutput]:
        """One iteration: schedule a batch, run the model on it, turn logits into tokens.

        A fault in one request's work fails that request alone (``Scheduler``); a fault in the
        forward pass, which is shared, fails the requests of that batch (their own memory may
        be half-written; the tree's is only read) and leaves the waiting ones queued."""
        t = time.perf_counter()
        batch, outs = self.scheduler.schedule()
        t = self._clock(_SCHEDULE, t)
        if batch is not None:
            start = t
            try:
                logits = self.runner.forward(batch.inputs)
            except Exception as e:
                t = self._clock(_FORWARD, t)
                log.exception("forward pass failed; failing its %d requests", len(batch.reqs))
                outs += self.scheduler.fail(batch.reqs, e)
                return self._finish_step(outs, t)
            t = self._clock(_FORWARD, t)
            picked = [r for r, s in zip(batch.reqs, batch.samples, strict=True) if s]
            rows = [i for i, s in enumerate(batch.samples) if s]
            sampled = iter(self.runner.sample(logits[rows], picked))
            tokens = [next(sampled) if s else None for s in batch.samples]
            t = self._clock(_SAMPLE, t)
            outs += self.scheduler.postprocess(batch, tokens)
            self.steps += 1
            log.debug(
                "step %d: %d reqs, %d tokens, %.1f ms",
                self.steps,
                len(batch.reqs),
                batch.num_tokens,
                1e3 * (time.perf_counter() - start),
            )
        return self._finish_step(outs, t)

    def _finish_step(self, outs: list[StepOutput], t: float) -> list[StepOutput]:
        for out in outs:
            self._account(out)
        if self.config.check_integrity:
            self.manager.check_integrity(idle=not self.has_unfinished())
        self._clock(_POSTPROCESS, t)
        return outs

    def _clock(self, phase: int, since: float) -> float:
        """Adds the time from ``since`` to now to ``phase``; returns now."""
        now = time.perf_counter()
        self._phase_s[phase] += now - since
        return now

    def _account(self, out: StepOutput) -> None:
        self.generated_tokens += len(out.token_ids)
        if out.finished:
            self.requests_finished += 1
            self.prompt_tokens += out.prompt_tokens
            self.cached_tokens += out.cached_tokens
            log.debug(
                "%s finished (%s): %d prompt, %d cached, %d completion tokens",
                out.rid,
                out.finish_reason,
                out.prompt_tokens,
                out.cached_tokens,
                out.completion_tokens,
            )

    # ------------------------------------------------------------------ inspection
    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            requests_finished=self.requests_finished,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            generated_tokens=self.generated_tokens,
            steps=self.steps,
            step_times=StepTimes(*self._phase_s),
            size=self.manager.size_info(),
            cache=dataclasses.replace(self.cache.stats),
            kv_bytes_per_slot=self.cache.pools.kv.slot_bytes if self.cache.pools.kv else 0,
            state_bytes_per_slot=self.cache.cost.state_bytes,
            alpha=self.cache.alpha,
        )

    def check_integrity(self) -> None:
        """Deep cache check; when no request is in flight, also that every slot is back."""
        self.manager.check_integrity(idle=not self.has_unfinished())

    def describe(self) -> str:
        """One line: model, cache policy and size."""
        kv, st = self.cache.pools.kv, self.cache.pools.state
        assert kv is not None and st is not None
        return (
            f"model {self.config.model} ({self.model.config.architecture}), prefix cache "
            f"{self.config.prefix_cache}, {self.setup.nbytes / 2**30:.2f} GiB "
            f"(up to {kv.num_slots * kv.page_size} KV tokens or {st.num_slots} states), "
            f"context {self.context_length}"
        )

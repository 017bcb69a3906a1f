"""Engine configuration: one frozen dataclass, the single source of defaults for the CLI.

``EngineConfig`` holds what the user asked for ("auto" allowed where noted); ``Engine`` resolves
the "auto" values once, at construction, and never mutates the config.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from marconi.cache.presets import PRESETS, get_preset
from marconi.engine.schedule_policy import SCHEDULE_POLICIES
from marconi.units import parse_alpha, parse_bytes, split_size

#: ``--prefix-cache`` choices: every cache preset, plus ``none`` (no reuse, same memory pools).
NO_CACHE = "none"


def prefix_cache_choices() -> list[str]:
    return [*PRESETS, NO_CACHE]


#: ``--alpha auto`` starts here (the paper's start, LRU order); the shadow tuner moves it.
AUTO_ALPHA_FALLBACK = 0.0


class ConfigError(ValueError):
    """A setting this machine or model cannot serve with (the message names the flag)."""


def memory_fraction(text: str | int | float) -> float | None:
    """The fraction of the device's memory that a ``parse_memory`` text asks for (``"0.25"``),
    or None where it gives a size; raises ValueError where it is neither."""
    value, unit = split_size(text)
    if unit == "" and 0 < value < 1:
        return value
    if parse_bytes(text) <= 0:
        raise ValueError(f"memory size must be > 0, got {text!r}")
    return None


def parse_memory(text: str | int | float, device: str = "cpu") -> int:
    """Bytes from ``"2GB"``, ``"512MiB"``, ``"1e9"`` or a fraction of the device's memory
    (``"0.25"``: a quarter of the RAM, or of the GPU's memory on CUDA). Raises ValueError."""
    fraction = memory_fraction(text)
    if fraction is None:
        return parse_bytes(text)
    nbytes = int(fraction * device_memory_bytes(device))
    if nbytes <= 0:
        raise ConfigError(f"--cache-memory {text} is less than one byte of {device}'s memory")
    return nbytes


def device_memory_bytes(device: str) -> int:
    """Total memory of ``device``: the GPU's on CUDA, else physical RAM."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; the server's flags are generated from these fields.

    - ``model``: ``tiny`` / ``tiny-jamba`` / ``small`` (embedded, built on first use) or a local
      HF folder.
    - ``prefix_cache``: a cache preset (``marconi.cache.presets``) or ``none``.
    - ``cache_memory``: one byte budget for KV + SSM states, request working memory included
      (``2GB``, ``512MiB``, or a fraction of the device's memory such as ``0.2``). The model's
      KV and state tensors are allocated for exactly this many bytes.
    - ``alpha``: FLOP-aware eviction weight: ``auto`` (online tuning when available) or a float.
    - ``max_running_requests``: requests admitted at once (decode batch size bound).
    - ``chunked_prefill_size``: prefill tokens per step over all requests (the token budget);
      a longer prompt is prefilled in chunks across steps, interleaved with decodes.
    - ``schedule_policy``: admission order of waiting requests, ``srpf`` (shortest remaining
      prefill first: ``spf`` that also lets shorter arrivals go before a mid-prefill
      remainder, up to half its uncached prompt), ``spf`` (shortest prefill first), ``fcfs``
      or ``lpm`` (longest cached prefix first; ``marconi.engine.schedule_policy``).
    - ``context_length``: longest prompt + completion; ``None`` = the model's
      ``max_position_embeddings`` (8192 if absent).
    - ``default_max_tokens``: completion length cap when a request gives none.
    - ``queue_timeout``: seconds a request may wait for admission before it ends with
      ``finish_reason="timeout"`` (the server answers 503); ``None`` = no limit.
    """

    model: str = "tiny"
    prefix_cache: str = "marconi"
    cache_memory: str = "1GB"
    alpha: str = "auto"
    max_running_requests: int = 32
    chunked_prefill_size: int = 256
    schedule_policy: str = "srpf"
    context_length: int | None = None
    default_max_tokens: int = 256
    queue_timeout: float | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    check_integrity: bool = field(default=False)  # deep cache check after every step (tests)

    def __post_init__(self) -> None:
        if self.prefix_cache not in prefix_cache_choices():
            raise ValueError(
                f"unknown prefix cache {self.prefix_cache!r}; "
                f"choose one of {', '.join(prefix_cache_choices())}"
            )
        parse_alpha(self.alpha)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda"):
            memory_fraction(self.cache_memory)  # the syntax; the GPU is read when it is used
        else:
            _ = self.cache_bytes  # the RAM's size is cheap to read: the whole check, now
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")
        SCHEDULE_POLICIES.get(self.schedule_policy)  # raises ValueError listing the choices
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError("queue_timeout must be > 0 seconds")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("context_length must be >= 2")

    @property
    def cache_enabled(self) -> bool:
        return self.prefix_cache != NO_CACHE

    @cached_property
    def cache_bytes(self) -> int:
        """``cache_memory`` in bytes, read once (a fraction reads the device's memory)."""
        return parse_memory(self.cache_memory, self.device)

    def resolve_cache(self) -> CacheSetup:
        """The "auto" values of the cache, resolved once (``Engine`` calls this at construction)."""
        reuse = self.cache_enabled
        preset = self.prefix_cache if reuse else NO_CACHE_PRESET
        alpha = parse_alpha(self.alpha)
        tune = reuse and alpha is None and get_preset(preset).tune_alpha
        start = AUTO_ALPHA_FALLBACK if alpha is None else alpha
        total = device_memory_bytes(self.device)
        if self.cache_bytes > total:
            raise ConfigError(
                f"--cache-memory {self.cache_memory} ({self.cache_bytes / 2**30:.1f} GiB) is more"
                f" than the memory of {self.device} ({total / 2**30:.1f} GiB)"
            )
        return CacheSetup(preset, start, tune, reuse, self.cache_bytes)


#: the preset whose pools ``--prefix-cache none`` allocates from (it never matches nor inserts)
NO_CACHE_PRESET = "sglang+"


class CacheSetup(NamedTuple):
    """``EngineConfig``'s cache choices with "auto" resolved."""

    preset: str  # a name in ``marconi.cache.presets``
    alpha: float  # the FLOP-aware weight to start from
    tune_alpha: bool  # a shadow tuner moves ``alpha`` online
    reuse: bool  # False for ``--prefix-cache none`` (``marconi.cache.lease.NoReuse``)
    nbytes: int  # the byte budget of KV + states

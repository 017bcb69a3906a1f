"""Named cache presets, used everywhere (CLI, engine, plots).

| preset        | admission                                  | eviction               | page |
|---------------|--------------------------------------------|------------------------|------|
| vllm+         | a state every 32 tokens                    | LRU                    | 32   |
| sglang+       | the paper's (branch point + last decoded)  | LRU                    | 1    |
| marconi       | branch point + learned kinds (ghosts)      | hit density, tuned     | 1    |
| marconi-paper | the paper's                                | FLOP-aware, tuned      | 1    |
| sglang-0.5    | last 256-aligned position + branch         | LRU                    | 1    |
| vllm-0.32     | 512-aligned replay point + junctions       | LRU                    | 512  |

``marconi`` is ours (docs/admission.md); ``marconi-paper`` is the paper's design with our
shadow-cache alpha tuner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from marconi.cache.prefix_cache import CacheConfig


@dataclass(frozen=True)
class CachePreset:
    name: str
    config: CacheConfig
    tune_alpha: bool  # alpha is tuned online ("auto")
    description: str


PRESETS: dict[str, CachePreset] = {
    p.name: p
    for p in (
        CachePreset(
            "vllm+",
            CacheConfig("every-n", {"n": 32}, "lru", page_size=32),
            False,
            "vLLM prefix caching extended with a state every 32 tokens (paper baseline)",
        ),
        CachePreset(
            "sglang+",
            CacheConfig("marconi", {}, "lru"),
            False,
            "SGLang radix cache with Marconi's admission and LRU eviction (paper baseline)",
        ),
        CachePreset(
            "marconi",
            CacheConfig("learned", {}, "hit-density"),
            True,
            "Marconi, ours: branch point + the candidate kinds that get reused (learned from"
            " ghost entries) + hit-density eviction with a tuned value weight",
        ),
        CachePreset(
            "marconi-paper",
            CacheConfig("marconi", {}, "flop-aware"),
            True,
            "Marconi as in the paper: branch point + last decoded, FLOP-aware eviction with"
            " tuned alpha",
        ),
        CachePreset(
            "sglang-0.5",
            CacheConfig("chunk-aligned", {"interval": 256}, "lru"),
            False,
            "SGLang 0.5 extra_buffer mode: chunk-aligned states + branch checkpoints, LRU",
        ),
        CachePreset(
            "vllm-0.32",
            CacheConfig("align-junctions", {"block": 512}, "lru", page_size=512),
            False,
            "vLLM 0.32 align mode: block-aligned replay point + shared-prefix junctions, LRU",
        ),
    )
}


def get_preset(name: str) -> CachePreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown cache preset {name!r}; choose one of {', '.join(PRESETS)}"
        ) from None


def preset_config(
    name: str,
    alpha: float | None = None,
    page_size: int | None = None,
    match_rule: str | None = None,
) -> CacheConfig:
    """The preset's config, with an explicit alpha, page size or match rule if given."""
    cfg = get_preset(name).config
    given = {"alpha": alpha, "page_size": page_size, "match_rule": match_rule}
    return replace(cfg, **{k: v for k, v in given.items() if v is not None})

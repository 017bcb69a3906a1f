"""The ``sglang.srt.plugins`` entry point: ``marconi = ...integrations.sglang.plugin:register``.

SGLang calls ``register()`` in every process it starts (launcher, scheduler, detokenizer) via
``sglang.srt.plugins.load_plugins``. It

1. registers the ``marconi`` radix-cache backend with ``register_radix_cache_backend`` (selected
   by ``--radix-cache-backend marconi``); the factory imports the backend lazily, so loading the
   plugin costs nothing until the cache is built;
2. adds two flags to SGLang's server parser (an AFTER hook on ``ServerArgs.add_cli_args``):
   ``--prefix-cache {marconi,lru}``, which sets ``radix_cache_backend`` (``lru`` = SGLang's
   default cache, i.e. no backend), and ``--marconi-alpha``, the FLOP-aware weight (``auto``, the
   default: tuned online; or a fixed float), passed to the scheduler processes through
   ``$SGLANG_MARCONI_ALPHA``, and ``--marconi-preset {marconi,marconi-paper}`` (the
   ``marconi.cache`` preset whose admission and eviction the backend runs; default ``marconi``),
   through ``$SGLANG_MARCONI_PRESET``;
3. registers ``JambaForCausalLM`` (``integrations/sglang/models/jamba.py``) with SGLang's model
   registry and its config (``jamba_config.register_jamba_config``): see ``register_models``;
4. on a CPU, binds marconi's Mamba kernels into SGLang's mixers (``cpu_binding``) and, through a
   BEFORE hook on ``ServerArgs.resolve_once``, picks the settings SGLang needs there
   (``cpu_defaults``);
5. with the ``marconi`` backend, ends a prefill chunk at every prefill position the admission
   planned (branch point, one before the prompt end, ...) so ``no_buffer`` mode caches its state
   (AROUND hooks on ``PrefillAdder.add_one_req`` and ``add_chunked_req``: ``branch_split``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from marconi.integrations.sglang.names import ALPHA_ENV, BACKEND_NAME, PRESET_ENV, SGLANG_PRESETS
from marconi.units import AUTO, parse_alpha

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

#: ``--prefix-cache`` value -> ``--radix-cache-backend`` value (None: SGLang's default chain)
PREFIX_CACHE_CHOICES: dict[str, str | None] = {"marconi": BACKEND_NAME, "lru": None}
ADD_CLI_ARGS_TARGET = "sglang.srt.server_args.ServerArgs.add_cli_args"
MODELS_PACKAGE = "marconi.integrations.sglang.models"
EXTERNAL_MODELS_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
REGISTRY_MODULE = "sglang.srt.models.registry"


def _factory(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    from marconi.integrations.sglang.backend import marconi_cache_factory

    return marconi_cache_factory(ctx)


class _FlagAction(argparse.Action):
    """An action that stores what ``apply(parser, namespace, value)`` returns."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.apply(parser, namespace, str(values)))

    def apply(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
              value: str) -> Any:  # fmt: skip
        raise NotImplementedError


class PrefixCacheAction(_FlagAction):
    """``--prefix-cache NAME``: writes the mapped backend into ``radix_cache_backend``."""

    def apply(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
              value: str) -> Any:  # fmt: skip
        namespace.radix_cache_backend = PREFIX_CACHE_CHOICES[value]
        return value


class MarconiPresetAction(_FlagAction):
    """``--marconi-preset NAME``: exported as ``$SGLANG_MARCONI_PRESET`` for the cache
    processes."""

    def apply(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
              value: str) -> Any:  # fmt: skip
        os.environ[PRESET_ENV] = value
        return value


class MarconiAlphaAction(_FlagAction):
    """``--marconi-alpha auto|X``: exported as ``$SGLANG_MARCONI_ALPHA`` for the cache
    processes (the namespace gets None for ``auto``, else the float)."""

    def apply(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
              value: str) -> Any:  # fmt: skip
        try:
            alpha = parse_alpha(value)
        except ValueError as e:
            parser.error(f"--marconi-alpha: {e}")
        os.environ[ALPHA_ENV] = AUTO if alpha is None else repr(alpha)
        return alpha


def add_prefix_cache_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--prefix-cache``, ``--marconi-preset`` and ``--marconi-alpha`` to an SGLang server
    parser (idempotent)."""
    if "--prefix-cache" in parser._option_string_actions:
        return
    parser.add_argument(
        "--prefix-cache",
        action=PrefixCacheAction,
        choices=sorted(PREFIX_CACHE_CHOICES),
        default=None,
        help="Prefix cache for hybrid (attention + Mamba) models. 'marconi': Marconi's "
        "admission and eviction (--marconi-preset; same as --radix-cache-backend marconi). "
        "'lru': SGLang's default radix cache.",
    )
    parser.add_argument(
        "--marconi-preset",
        action=MarconiPresetAction,
        choices=SGLANG_PRESETS,
        default=None,
        help="Which Marconi design the backend runs: 'marconi' (default: branch point + the "
        "candidate states that get reused, learned online; hit-density eviction) or "
        "'marconi-paper' (branch point + last decoded token, FLOP-aware eviction).",
    )
    parser.add_argument(
        "--marconi-alpha",
        action=MarconiAlphaAction,
        default=None,
        help="Value weight of Marconi's eviction score (FLOP efficiency for marconi-paper, "
        "the prefix a hit gives for marconi): 'auto' (default) tunes it online with shadow "
        "caches fed by finished requests; a float >= 0 fixes it.",
    )


def _after_add_cli_args(result: Any, parser: argparse.ArgumentParser, *args: Any) -> None:
    add_prefix_cache_args(parser)


def register_models() -> None:
    """Make SGLang's ``ModelRegistry`` serve ``MODELS_PACKAGE``'s models (idempotent).

    SGLang's supported mechanism is ``$SGLANG_EXTERNAL_MODEL_PACKAGE``, read once when
    ``sglang.srt.models.registry`` is first imported: the registry then loads that package's
    ``EntryClass``es first and SGLang's own models only when another architecture is asked for.
    When the variable is free it is set here (every process SGLang spawns inherits it, and the
    plugin runs before the registry is imported); when the registry is already imported, or the
    variable names another package, the package is added with ``ModelRegistry.register`` (which
    imports SGLang's models first, as it always does)."""
    current = os.environ.get(EXTERNAL_MODELS_ENV)
    if not current:
        os.environ[EXTERNAL_MODELS_ENV] = current = MODELS_PACKAGE
    if REGISTRY_MODULE in sys.modules or current != MODELS_PACKAGE:
        from sglang.srt.models.registry import ModelRegistry

        from marconi.integrations.sglang.jamba_config import ARCH

        if ARCH not in ModelRegistry.models:
            ModelRegistry.register(MODELS_PACKAGE, overwrite=True)


def register() -> None:
    """The plugin entry point (idempotent)."""
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, _factory)
    from marconi.integrations.sglang.branch_split import (
        ADD_CHUNKED_REQ_TARGET,
        ADD_ONE_REQ_TARGET,
        split_prefill_at_plan,
    )
    from marconi.integrations.sglang.cpu_defaults import RESOLVE_TARGET, apply_cpu_defaults

    for target, hook, kind in (
        (ADD_CLI_ARGS_TARGET, _after_add_cli_args, HookType.AFTER),
        (RESOLVE_TARGET, apply_cpu_defaults, HookType.BEFORE),
        (ADD_ONE_REQ_TARGET, split_prefill_at_plan, HookType.AROUND),
        (ADD_CHUNKED_REQ_TARGET, split_prefill_at_plan, HookType.AROUND),
    ):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, kind)

    from marconi.integrations.sglang.jamba_config import register_jamba_config

    register_jamba_config()
    register_models()

    from marconi.integrations.sglang.cpu_binding import bind_cpu_kernels

    bind_cpu_kernels()

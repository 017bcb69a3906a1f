"""Server settings that let SGLang 0.5.23 serve a hybrid model on a CPU, picked for the user.

With marconi's CPU kernels bound (``cpu_binding``), ``--device cpu`` still fails on SGLang's
defaults: its CPU attention default (``intel_amx`` on x86) needs sgl-kernel's CPU build, and its
``auto`` Mamba cache strategy picks ``extra_buffer`` (overlap scheduling) and then asserts that
the platform can snapshot states, which only accelerators can. ``apply_cpu_defaults`` (a BEFORE
hook on ``ServerArgs.resolve_once``, so every process sees the result) fills in what the user left
at SGLang's default and logs each choice:

- ``--attention-backend`` -> ``torch_native`` (portable SDPA; needs no CPU kernel build);
- ``--disable-overlap-schedule`` -> on (``auto`` then resolves to ``no_buffer``: no state
  snapshots on CPU);
- ``--dtype auto`` -> ``float32`` unless the checkpoint says bfloat16 (SGLang's ``auto`` turns
  fp32 into fp16, slow and lossy on CPU);
- ``$SGLANG_MAMBA_CONV_DTYPE`` -> ``float32`` when serving float32 (SGLang's default: bf16).

Anything the user set explicitly is left alone.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from marconi.integrations.sglang.cpu_binding import sglang_has_mamba_kernels

logger = logging.getLogger(__name__)

RESOLVE_TARGET = "sglang.srt.server_args.ServerArgs.resolve_once"
CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"


def _checkpoint_dtype(model_path: str | None) -> str | None:
    cfg = Path(model_path or "") / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    return data.get("torch_dtype") or data.get("dtype")


def _serving_on_cpu(args: Any) -> bool:
    return getattr(args, "device", None) == "cpu" and not sglang_has_mamba_kernels()


def cpu_choices(args: Any) -> dict[str, Any]:
    """The settings to change on ``args`` (a ServerArgs), empty unless serving on a CPU."""
    if not _serving_on_cpu(args):
        return {}
    out: dict[str, Any] = {}
    if args.attention_backend is None:
        out["attention_backend"] = "torch_native"
    if not args.disable_overlap_schedule:
        out["disable_overlap_schedule"] = True
    if args.dtype == "auto" and _checkpoint_dtype(args.model_path) != "bfloat16":
        out["dtype"] = "float32"
    return out


def apply_cpu_defaults(args: Any, *rest: Any, **kwargs: Any) -> None:
    """BEFORE hook on ``ServerArgs.resolve_once``: write ``cpu_choices`` into ``args``."""
    if getattr(args, "_resolution_finished", False):
        return
    choices = cpu_choices(args)
    for name, value in choices.items():
        setattr(args, name, value)
    if args.dtype == "float32" and _serving_on_cpu(args):
        os.environ.setdefault(CONV_DTYPE_ENV, "float32")
    if choices:
        shown = ", ".join(f"{k}={v!r}" for k, v in choices.items())
        logger.warning(
            "marconi: serving on CPU with SGLang (Mamba kernels: marconi's CPU kernels); chose %s",
            shown,
        )

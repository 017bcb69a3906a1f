"""The one place where marconi rebinds names inside SGLang: its Mamba kernels, on CPU only.

SGLang 0.5.23's ``layers/attention/mamba/mamba.py`` imports its causal-conv kernels only on
CUDA/NPU/XPU (elsewhere the names are unbound and the first prefill raises ``NameError``), and its
SSD scan / state update are Triton kernels with no CPU backend. When SGLang bound no conv kernel
(i.e. it is running on a CPU), ``bind_cpu_kernels`` sets the names below to
``cpu_kernels``' functions in the modules that look them up at call time. On any accelerator it
changes nothing. ``test_sglang_cpu_kernels.py`` fails loudly if SGLang moves or renames them.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

MAMBA2 = "sglang.srt.layers.attention.mamba.mamba"
MAMBA1 = "sglang.srt.layers.attention.mamba.mamba1"
#: module -> the kernel names it calls (all read from module globals at call time)
TARGETS: dict[str, tuple[str, ...]] = {
    MAMBA2: (
        "causal_conv1d_fn",
        "causal_conv1d_update",
        "causal_conv1d_fn_triton",
        "causal_conv1d_update_triton",
        "mamba_chunk_scan_combined",
        "selective_state_update",
    ),
    MAMBA1: (
        "causal_conv1d_fn",
        "causal_conv1d_update",
        "causal_conv1d_fn_triton",
        "causal_conv1d_update_triton",
        "selective_state_update",
    ),
}
#: (module, class, attribute) -> the cpu_kernels function installed as a staticmethod there
METHODS: dict[tuple[str, str, str], str] = {
    (MAMBA1, "MambaMixer1", "_selective_scan"): "mamba1_selective_scan",
}
#: the name SGLang binds on every platform that has Mamba kernels
PLATFORM_PROBE = "causal_conv1d_fn"


def sglang_has_mamba_kernels() -> bool:
    """True when SGLang bound its own conv kernels (an accelerator platform)."""
    mod = importlib.import_module(MAMBA2)
    fn = getattr(mod, PLATFORM_PROBE, None)
    return fn is not None and not getattr(fn, "__module__", "").startswith("marconi.")


def bind_cpu_kernels() -> bool:
    """Install marconi's CPU kernels into SGLang's Mamba mixers when SGLang has none (idempotent).

    Returns whether the CPU kernels are bound. The plugin's entry point calls it in every SGLang
    process, before any model (and so ``mamba1.py``, which copies the conv names) is imported."""
    if sglang_has_mamba_kernels():
        return False
    from marconi.integrations.sglang import cpu_kernels

    for module, names in TARGETS.items():  # mamba.py first: mamba1.py imports its conv names
        mod = importlib.import_module(module)
        for name in names:
            setattr(mod, name, getattr(cpu_kernels, name.removesuffix("_triton")))
    for (module, cls, attr), name in METHODS.items():
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, attr, staticmethod(getattr(cpu_kernels, name)))
    logger.debug(
        "marconi: SGLang has no Mamba kernels on this platform; bound marconi's CPU kernels"
    )
    return True

"""HF architecture name -> our model class."""

from __future__ import annotations

from marconi.models.hybrid import HybridForCausalLM
from marconi.models.jamba import JambaForCausalLM
from marconi.models.mamba2_hybrid import Mamba2HybridForCausalLM

MODEL_REGISTRY: dict[str, type[HybridForCausalLM]] = {
    arch: cls for cls in (Mamba2HybridForCausalLM, JambaForCausalLM) for arch in cls.architectures
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def model_class(architecture: str) -> type[HybridForCausalLM]:
    """The class serving `architecture`; ValueError naming the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {supported_architectures()}"
        ) from None

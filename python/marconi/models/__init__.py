"""Hybrid model runtime: model classes, the HF loader, tokenizers and the embedded tiny models.

Typical use::

    model = load_model("tiny")
    memory = model.allocate_memory(num_kv_slots=4096, num_state_slots=64)
    out = model(ForwardBatch((SequenceInput(ids, kv_slots=range(len(ids)), state_slot=0),)), memory)
"""

from __future__ import annotations

from marconi.models.batch import ForwardBatch, ForwardOutput, SequenceInput
from marconi.models.config import HybridConfig, SublayerSpec
from marconi.models.hybrid import HybridForCausalLM
from marconi.models.jamba import JambaForCausalLM
from marconi.models.loader import ModelLoadError, load_model, resolve_model_path
from marconi.models.mamba2_hybrid import Mamba2HybridForCausalLM
from marconi.models.memory import HybridMemory, StateSnapshot
from marconi.models.registry import MODEL_REGISTRY, model_class, supported_architectures
from marconi.models.tiny import ensure_tiny
from marconi.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "MODEL_REGISTRY",
    "ByteTokenizer",
    "ForwardBatch",
    "ForwardOutput",
    "HFTokenizer",
    "HybridConfig",
    "HybridForCausalLM",
    "HybridMemory",
    "JambaForCausalLM",
    "Mamba2HybridForCausalLM",
    "ModelLoadError",
    "SequenceInput",
    "StateSnapshot",
    "SublayerSpec",
    "ensure_tiny",
    "load_model",
    "load_tokenizer",
    "model_class",
    "resolve_model_path",
    "supported_architectures",
]

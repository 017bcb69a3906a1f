"""Compute kernels for hybrid (Attention + SSM) models, in plain torch.

Every layer works on *packed* token batches (all requests' new tokens concatenated) described by
`marconi.layers.batch_meta.BatchMeta`, and reads/writes its per-request memory (KV slots, SSM
state slots) through tensors owned by `marconi.models.memory.HybridMemory`.
"""

from __future__ import annotations

from marconi.layers.attention import PagedAttention, RotaryEmbedding
from marconi.layers.batch_meta import BatchMeta, build_batch_meta
from marconi.layers.conv import causal_conv1d, causal_conv1d_step
from marconi.layers.mamba1 import Mamba1Mixer
from marconi.layers.mamba2 import Mamba2Mixer, SegmentPlan, ssd_scan
from marconi.layers.mlp import MLP, activation
from marconi.layers.moe import MoE
from marconi.layers.norm import RMSNorm, gated_rms_norm, rms_norm

__all__ = [
    "MLP",
    "BatchMeta",
    "Mamba1Mixer",
    "Mamba2Mixer",
    "MoE",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SegmentPlan",
    "activation",
    "build_batch_meta",
    "causal_conv1d",
    "causal_conv1d_step",
    "gated_rms_norm",
    "rms_norm",
    "ssd_scan",
]

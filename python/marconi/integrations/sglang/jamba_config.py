"""Jamba's HF config as SGLang's hybrid-cache machinery needs it, and its registrations.

SGLang 0.5.23 has no Jamba; its hybrid (attention + state-space) paths find a model's state
layout through ``sglang.srt.configs.hybrid_arch.mambaish_config(model_config)``: a fixed list of
config classes, then the public linear-attention registry
(``sglang.srt.configs.linear_attn_model_registry.register_linear_attn_model``, the documented
hook for external hybrid models). Whatever it returns must expose what SGLang's own Mamba-1
configs (``sglang.srt.configs.mamba.FalconMambaConfig``) expose:

- ``full_attention_layer_ids``: the KV-pool layers (``HybridLinearKVPool``);
- ``mamba2_cache_params``: the ``MambaPool`` layout: ``Mamba2StateShape.create_full_rank`` (SGLang's
  Mamba-1 layout: conv state [d_inner/tp, d_conv-1], SSM state [d_inner/tp, 1, d_state]) over
  the Mamba layer ids, dtypes from ``mamba2_state_dtype`` (conv: ``$SGLANG_MAMBA_CONV_DTYPE``,
  default bf16; SSM: ``mamba_ssm_dtype`` or ``$SGLANG_MAMBA_SSM_DTYPE``, default fp32);
- ``mamba_chunk_size``: for Mamba-1 only the grid on which the radix cache may place states
  (there is no chunked scan; it must exceed the conv window). SGLang's FalconMamba uses 256;
  Jamba uses 16 here, so a branch-point state lands at most 15 tokens before the branch.

``JambaConfig`` adds these to transformers' ``JambaConfig`` (layer ``i`` is attention iff
``i % attn_layer_period == attn_layer_offset``, else Mamba-1). ``register_jamba_config`` makes
``AutoConfig`` (which SGLang's HF config parser calls) build it for ``model_type == "jamba"`` and
registers the linear-attention spec: SGLang's ``Mamba2AttnBackend`` (which drives SGLang's Mamba-1
mixer), Mamba radix cache on, ``extra_buffer`` off (SGLang's ``MambaMixer1`` rejects tracked
states), so ``--mamba-radix-cache-strategy auto`` resolves to ``no_buffer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import AutoConfig
from transformers import JambaConfig as HFJambaConfig

if TYPE_CHECKING:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams

ARCH = "JambaForCausalLM"
MODEL_TYPE = "jamba"
#: Mamba-1's state grid for the radix cache (SGLang's FalconMamba: 256). Any position is an exact
#: state for a Mamba-1 scan; the grid only has to exceed the conv window (d_conv - 1).
MAMBA1_CHUNK_SIZE = 16
MAMBA2_BACKEND = "sglang.srt.layers.attention.hybrid_linear_attn_backend.Mamba2AttnBackend"


class JambaConfig(HFJambaConfig):
    """transformers' ``JambaConfig`` plus the hybrid-cache properties SGLang reads."""

    model_type = MODEL_TYPE
    mamba_chunk_size = MAMBA1_CHUNK_SIZE

    def is_attention_layer(self, layer_id: int) -> bool:
        return layer_id % self.attn_layer_period == self.attn_layer_offset

    def is_moe_layer(self, layer_id: int) -> bool:
        """MoE feed-forward iff ``i % expert_layer_period == expert_layer_offset`` and there is
        more than one expert (transformers' ``layers_num_experts``)."""
        return self.num_experts > 1 and (
            layer_id % self.expert_layer_period == self.expert_layer_offset
        )

    @property
    def full_attention_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_attention_layer(i)]

    @property
    def mamba_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_attention_layer(i)]

    @property
    def mamba_intermediate_size(self) -> int:
        """d_inner = ``mamba_expand * hidden_size`` (``intermediate_size`` is the MLP's)."""
        return int(self.mamba_expand) * int(self.hidden_size)

    @property
    def mamba2_cache_params(self) -> Mamba2CacheParams:
        """The per-request Mamba-1 state of all Mamba layers, sharded over SGLang's TP group
        (``get_parallel().tp_size``, the group ``MambaMixer1`` shards ``d_inner`` over), so it
        needs SGLang's published parallel context, as every SGLang worker has."""
        from sglang.srt.configs.mamba_utils import (
            Mamba2CacheParams,
            Mamba2StateShape,
            mamba2_state_dtype,
        )
        from sglang.srt.runtime_context import get_parallel

        shape = Mamba2StateShape.create_full_rank(
            tp_world_size=get_parallel().tp_size,
            intermediate_size=self.mamba_intermediate_size,
            state_size=int(self.mamba_d_state),
            conv_kernel=int(self.mamba_d_conv),
        )
        return Mamba2CacheParams(
            shape=shape, layers=self.mamba_layer_ids, dtype=mamba2_state_dtype(self)
        )


def register_jamba_config() -> None:
    """Idempotent: ``AutoConfig`` builds ``JambaConfig`` for ``model_type == "jamba"`` and
    SGLang's linear-attention registry knows it."""
    from sglang.srt.configs.linear_attn_model_registry import (
        LinearAttnModelSpec,
        get_linear_attn_spec_by_arch,
        register_linear_attn_model,
    )

    AutoConfig.register(MODEL_TYPE, JambaConfig, exist_ok=True)
    if get_linear_attn_spec_by_arch(ARCH) is None:
        register_linear_attn_model(
            LinearAttnModelSpec(
                config_class=JambaConfig,
                backend_class_name=MAMBA2_BACKEND,
                arch_names=[ARCH],
                uses_mamba_radix_cache=True,
                support_mamba_cache=True,
                support_mamba_cache_extra_buffer=False,
            )
        )

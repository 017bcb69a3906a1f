"""``JambaForCausalLM`` for SGLang 0.5.23, built from SGLang's own layers.

Layer ``i`` (transformers' ``JambaConfig``): mixer = attention iff ``i % attn_layer_period ==
attn_layer_offset`` (no positional encoding: Jamba has no RoPE), else Mamba-1; feed-forward = MoE
iff ``i % expert_layer_period == expert_layer_offset`` (and ``num_experts > 1``), else a gated
SiLU MLP. Each layer: ``h += mixer(input_layernorm(h)); h += ffn(pre_ff_layernorm(h))`` (SGLang's
fused residual RMSNorm), then ``final_layernorm`` and the LM head.

Pieces (all imported from the installed ``sglang``):

- attention: ``QKVParallelLinear`` + ``RadixAttention`` (layer id = the global layer index, as
  ``HybridLinearKVPool`` expects) + ``RowParallelLinear``;
- Mamba-1: ``JambaMambaMixer`` (SGLang's ``MambaMixer1`` + Jamba's learned dt/B/C norms), run by
  SGLang's ``Mamba2AttnBackend`` with the layer's ``MambaPool`` state, as NemotronH does;
- MoE: ``ReplicatedLinear`` router, ``TopK(renormalize=False)`` over a softmax (Jamba does not
  renormalise the top-k weights), ``FusedMoE`` (gate/up fused into ``w13``), results all-reduced;
- MLP: SGLang's ``LlamaMLP`` (``gate_up_proj`` + SiLU-and-mul + ``down_proj``);
- ``VocabParallelEmbedding``, ``RMSNorm``, ``ParallelLMHead``, ``LogitsProcessor``.

Parallelism: tensor parallelism only (attention heads, d_inner, expert intermediate and the
vocabulary are sharded over SGLang's TP group); no pipeline parallelism, no data-parallel
attention. Weight names are the HF checkpoint's (``ai21labs/AI21-Jamba-1.5-Mini``):
``weight_target`` maps each one onto a parameter (see its docstring).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
from sglang.srt.layers.moe.topk import TopK
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_attn_backend
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama import LlamaMLP
from sglang.srt.runtime_context import get_parallel
from sglang.srt.utils import add_prefix
from torch import nn

from marconi.integrations.sglang.jamba_config import JambaConfig

logger = logging.getLogger(__name__)

#: (model param, checkpoint name, shard id) for the stacked (merged) projections.
STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


class JambaAttention(nn.Module):
    """GQA attention without positional encoding; KV heads replicated when fewer than TP."""

    def __init__(
        self,
        config: JambaConfig,
        layer_id: int,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        tp = get_parallel().tp_size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % tp or (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
            raise ValueError(
                f"Jamba: {heads} heads / {kv_heads} KV heads do not split over TP={tp}"
            )
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.q_size = heads // tp * self.head_dim
        self.kv_size = max(1, kv_heads // tp) * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, kv_heads, bias=False,
            quant_config=quant_config, prefix=add_prefix("qkv_proj", prefix),
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            heads * self.head_dim, config.hidden_size, bias=False,
            quant_config=quant_config, prefix=add_prefix("o_proj", prefix),
        )  # fmt: skip
        self.attn = RadixAttention(
            heads // tp, self.head_dim, self.head_dim**-0.5, num_kv_heads=max(1, kv_heads // tp),
            layer_id=layer_id, quant_config=quant_config, prefix=add_prefix("attn", prefix),
        )  # fmt: skip

    def forward(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out, _ = self.o_proj(self.attn(q, k, v, forward_batch))
        return out


class JambaMoE(nn.Module):
    """Softmax router, top-k without renormalisation, fused experts (all-reduced over TP)."""

    def __init__(
        self,
        config: JambaConfig,
        layer_id: int,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.router = ReplicatedLinear(
            config.hidden_size, config.num_experts, bias=False, quant_config=None,
            prefix=add_prefix("router", prefix),
        )  # fmt: skip
        self.topk = TopK(top_k=config.num_experts_per_tok, layer_id=layer_id, renormalize=False)
        self.experts = FusedMoE(
            num_experts=config.num_experts, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, layer_id=layer_id,
            top_k=config.num_experts_per_tok, reduce_results=True, quant_config=quant_config,
            prefix=add_prefix("experts", prefix),
        )  # fmt: skip
        self.topk.bind_runner_backend(self.experts.runner_backend)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_size)
        logits, _ = self.router(hidden_states)
        return self.experts(hidden_states, self.topk(hidden_states, logits)).view(shape)


class JambaDecoderLayer(nn.Module):
    """One Jamba layer: ``self_attn`` or ``mamba`` mixer, then ``feed_forward`` (MLP or MoE)."""

    def __init__(
        self,
        config: JambaConfig,
        layer_id: int,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.is_attention = config.is_attention_layer(layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.is_attention:
            self.self_attn = JambaAttention(
                config, layer_id, quant_config, add_prefix("self_attn", prefix)
            )
        else:
            # SGLang's Mamba-1 module only imports where its conv kernels exist (CUDA/NPU/XPU).
            from marconi.integrations.sglang.jamba_mixer import JambaMambaMixer

            self.mamba = JambaMambaMixer(config, quant_config, add_prefix("mamba", prefix))
        ffn_prefix = add_prefix("feed_forward", prefix)
        self.feed_forward: nn.Module
        if config.is_moe_layer(layer_id):
            self.feed_forward = JambaMoE(config, layer_id, quant_config, ffn_prefix)
        else:
            self.feed_forward = LlamaMLP(
                config.hidden_size, config.intermediate_size, config.hidden_act,
                quant_config=quant_config, prefix=ffn_prefix,
            )  # fmt: skip

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.is_attention:
            hidden_states = self.self_attn(hidden_states, forward_batch)
        else:
            hidden_states = get_attn_backend().linear_attn_backend.forward(
                mixer=self.mamba,
                layer_id=self.layer_id,
                hidden_states=hidden_states,
                output=None,
                forward_batch=forward_batch,
                use_triton_causal_conv=True,
            )
        hidden_states, residual = self.pre_ff_layernorm(hidden_states, residual)
        return self.feed_forward(hidden_states), residual


class JambaModel(nn.Module):
    def __init__(
        self, config: JambaConfig, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=add_prefix("embed_tokens", prefix)
        )
        self.layers = nn.ModuleList(
            JambaDecoderLayer(config, i, quant_config, add_prefix(f"layers.{i}", prefix))
            for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, forward_batch)
        hidden_states, _ = self.final_layernorm(hidden_states, residual)
        return hidden_states


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: ``param`` (a name in ``named_parameters()``), loaded
    by that parameter's SGLang ``weight_loader`` with ``shard`` (None: the whole tensor; "q"/"k"/
    "v" or 0/1 for stacked projections; "w1"/"w2"/"w3" for an expert) and ``expert``."""

    param: str
    shard: str | int | None = None
    expert: int | None = None


def weight_target(name: str, num_experts: int) -> WeightTarget:
    """The parameter an HF Jamba checkpoint tensor ``name`` loads into (pure; no lookup).

    - ``...experts.{e}.{gate,up,down}_proj.weight`` -> ``...experts.w13_weight`` (shard w1/w3)
      or ``...experts.w2_weight`` (w2), expert ``e`` (SGLang's
      ``FusedMoE.make_expert_params_mapping``);
    - ``...self_attn.{q,k,v}_proj.*`` -> ``...self_attn.qkv_proj.*`` (shard q/k/v);
      ``...feed_forward.{gate,up}_proj.*`` -> ``...feed_forward.gate_up_proj.*`` (shard 0/1);
    - everything else keeps its name (embeddings, norms, ``router``, ``o_proj``, ``down_proj``,
      every ``mamba.*`` tensor including ``A_log``, ``D`` and the dt/B/C norms, ``lm_head``).
    """
    if ".experts." in name:
        for param, ckpt, expert, shard in FusedMoE.make_expert_params_mapping(
            ckpt_gate_proj_name="gate_proj",
            ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj",
            num_experts=num_experts,
        ):
            if ckpt in name:
                return WeightTarget(name.replace(ckpt, param), shard, expert)
        raise ValueError(f"Jamba: unexpected expert tensor {name!r}")
    for param, ckpt, shard in STACKED_PARAMS:
        if ckpt in name:
            return WeightTarget(name.replace(ckpt, param), shard)
    return WeightTarget(name)


class JambaForCausalLM(nn.Module):
    """SGLang entry class (``EntryClass``); constructor and ``forward`` follow SGLang's model
    contract (``config``, ``quant_config``; ``forward(input_ids, positions, forward_batch)``)."""

    def __init__(
        self,
        config: JambaConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if not isinstance(config, JambaConfig):
            raise TypeError(
                f"JambaForCausalLM needs marconi's JambaConfig (got {type(config).__name__}); "
                "load the marconi SGLang plugin (marconi.integrations.sglang.plugin:register)"
            )
        if get_parallel().pp_size > 1:
            raise ValueError("JambaForCausalLM (marconi) supports tensor parallelism only")
        self.config = config
        self.quant_config = quant_config
        self.model = JambaModel(config, quant_config, add_prefix("model", prefix))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix=add_prefix("lm_head", prefix)
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
    ) -> LogitsProcessorOutput:
        hidden_states = self.model(input_ids, forward_batch, input_embeds)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors through each parameter's SGLang ``weight_loader`` (which takes
        this rank's TP shard); returns the parameter names that received at least one tensor.
        Unknown names are skipped with a warning; parameters left unloaded are warned about
        (a tied ``lm_head`` excepted)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = weight_target(name, self.config.num_experts)
            param = params.get(target.param)
            if param is None:
                logger.warning("Jamba: checkpoint tensor %s has no parameter; skipped", name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            if target.expert is not None:
                loader(param, tensor, target.param, shard_id=target.shard,
                       expert_id=target.expert)  # fmt: skip
            elif target.shard is not None:
                loader(param, tensor, target.shard)
            else:
                loader(param, tensor)
            loaded.add(target.param)
        missing = set(params) - loaded
        if self.config.tie_word_embeddings:
            missing -= {n for n in missing if n.startswith("lm_head.")}
        if missing:
            logger.warning("Jamba: parameters not in the checkpoint: %s", sorted(missing))
        return loaded


EntryClass = JambaForCausalLM

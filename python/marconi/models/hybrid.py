"""HybridForCausalLM: the generic pre-norm residual stack all our architectures share."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from marconi.cache.spec import CacheDtypes
from marconi.layers import (
    MLP,
    Mamba1Mixer,
    Mamba2Mixer,
    MoE,
    PagedAttention,
    RMSNorm,
    build_batch_meta,
)
from marconi.layers.attention import RotaryEmbedding
from marconi.layers.linear import Linear
from marconi.models.batch import ForwardBatch, ForwardOutput
from marconi.models.config import SSM_KINDS, HybridConfig, SublayerSpec
from marconi.models.memory import HybridMemory, dtype_name

#: (compiled full-match pattern, template). Templates are formatted with the match's named
#: groups plus m = 2i, f = 2i + 1, n = i for a group named `i` (HF layer index).
WeightRule = tuple[re.Pattern[str], str]


def rules(*pairs: tuple[str, str]) -> tuple[WeightRule, ...]:
    return tuple((re.compile(p), t) for p, t in pairs)


def _build_mixer(s: SublayerSpec) -> nn.Module:
    a = s.kwargs
    if s.kind == "mamba2":
        return Mamba2Mixer(**a)
    if s.kind == "mamba1":
        return Mamba1Mixer(**a)
    if s.kind == "attention":
        theta, partial = a.pop("rope_theta", None), a.pop("rope_partial", 1.0)
        rope = RotaryEmbedding(a["head_dim"], theta, partial) if theta is not None else None
        return PagedAttention(rope=rope, **a)
    if s.kind == "moe":
        return MoE(**a)
    return MLP(**a)


class Sublayer(nn.Module):
    """`norm` + `mixer`; the residual add lives in the model loop."""

    def __init__(self, s: SublayerSpec, hidden: int, eps: float) -> None:
        super().__init__()
        self.kind = s.kind
        self.norm = RMSNorm(hidden, eps)
        self.mixer = _build_mixer(s)


class HybridForCausalLM(nn.Module):
    """A stack of Mamba / attention / MLP / MoE sublayers over a paged HybridMemory.

    Subclasses supply `parse_config` (HF config.json -> HybridConfig) and `weight_rules`
    (HF tensor names -> ours). Our names: embed.weight, layers.{j}.norm.weight,
    layers.{j}.mixer.*, final_norm.weight, lm_head.weight.
    """

    architectures: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Sublayer(s, config.hidden_size, config.norm_eps) for s in config.sublayers
        )
        self.final_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # index of each sublayer inside HybridMemory's attention / SSM stacks
        attn = ssm = 0
        self._mem_index: list[int] = []
        for s in config.sublayers:
            if s.kind == "attention":
                self._mem_index.append(attn)
                attn += 1
            elif s.kind in SSM_KINDS:
                self._mem_index.append(ssm)
                ssm += 1
            else:
                self._mem_index.append(-1)

    # ---- construction from HF checkpoints -------------------------------------------------
    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> HybridConfig:
        raise NotImplementedError

    @classmethod
    def weight_rules(cls, config: HybridConfig) -> tuple[WeightRule, ...]:
        raise NotImplementedError

    @classmethod
    def convert_weights(
        cls, tensors: Iterable[tuple[str, torch.Tensor]], config: HybridConfig
    ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """(our state dict, unmatched HF names). Per-expert tensors (`@e`) are stacked and
        split projections (`#k`) concatenated along dim 0."""
        table = cls.weight_rules(config)
        parts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        unmatched: list[str] = []
        for name, t in tensors:
            for pat, tmpl in table:
                m = pat.fullmatch(name)
                if m:
                    g = m.groupdict()
                    if "i" in g:
                        i = int(g["i"])
                        g.update(m=2 * i, f=2 * i + 1, n=i)
                    new = tmpl.format(**g)
                    base, _, rest = new.partition("@")
                    expert, _, part = rest.partition("#")
                    if not rest:
                        base, _, part = new.partition("#")
                    key = (int(expert) if expert else -1, int(part) if part else 0)
                    parts.setdefault(base, {})[key] = t
                    break
            else:
                unmatched.append(name)
        out: dict[str, torch.Tensor] = {}
        for base, pieces in parts.items():
            experts = sorted({e for e, _ in pieces})
            per = [
                torch.cat([pieces[k] for k in sorted(k for k in pieces if k[0] == e)])
                for e in experts
            ]
            out[base] = per[0] if experts == [-1] else torch.stack(per)
        return out, unmatched

    # ---- runtime --------------------------------------------------------------------------
    def cache_dtypes(self) -> CacheDtypes:
        """The dtypes its cache is served in: KV and conv state in the weights' dtype, SSM state
        in fp32 (the scans' accumulation dtype)."""
        return CacheDtypes(dtype_name(self.embed.weight.dtype), "float32")

    def allocate_memory(
        self, num_kv_slots: int, num_state_slots: int, dtypes: CacheDtypes | None = None
    ) -> HybridMemory:
        """A HybridMemory for this model on its device (``cache_dtypes()`` unless given)."""
        dtypes = dtypes or self.cache_dtypes()
        return HybridMemory(
            self.config, num_kv_slots, num_state_slots, dtypes, self.embed.weight.device
        )

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, memory: HybridMemory) -> ForwardOutput:  # type: ignore[override]
        """Run `batch` (prefill, decode or mixed) against `memory`; see SequenceInput for the
        slot contract. Returns last-token logits (fp32) per request, optionally all of them."""
        meta = build_batch_meta(batch.requests, self.embed.weight.device)
        cfg = self.config
        h = self.embed(meta.tokens)
        if cfg.embedding_multiplier != 1.0:
            h = h * cfg.embedding_multiplier
        for layer, mi in zip(self.layers, self._mem_index, strict=True):
            x = layer.norm(h)
            if layer.kind == "attention":
                y = layer.mixer(x, meta, memory.k[mi], memory.v[mi])
            elif mi >= 0:
                y = layer.mixer(x, meta, memory.conv[mi], memory.ssm[mi])
            else:
                y = layer.mixer(x)
            if cfg.residual_multiplier == 1.0:
                h += y  # h is this forward's own buffer (embedding output or a sum)
            else:
                h.add_(y, alpha=cfg.residual_multiplier)
        last = self._logits(h[meta.last_index])
        all_logits = None
        if batch.return_all_logits:
            all_logits = tuple(self._logits(h).split(list(meta.new_lens)))
        return ForwardOutput(last, all_logits)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.final_norm(h)).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits


ParseFn = Callable[[dict[str, Any]], HybridConfig]

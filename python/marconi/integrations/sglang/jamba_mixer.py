"""Jamba's Mamba-1 mixer: SGLang's ``MambaMixer1`` plus learned RMSNorms on dt, B and C.

SGLang 0.5.23's ``MambaMixer1`` (``sglang/srt/layers/attention/mamba/mamba1.py``, used by
FalconMamba) computes ``dt, B, C`` from ``x_proj`` in ``_ssm_params`` and can only apply a
*weightless* RMSNorm to them (``use_bc_dt_rms``). Jamba (transformers' ``JambaMambaMixer``)
normalises them with learned ``JambaRMSNorm``s, ``dt_layernorm`` (dim ``dt_rank``),
``b_layernorm`` and ``c_layernorm`` (dim ``d_state``), before ``dt_proj``. ``JambaMambaMixer``
subclasses SGLang's mixer, adds the three norms (SGLang's ``RMSNorm``, checkpoint names
``mamba.{dt,b,c}_layernorm.weight``) and overrides ``_ssm_params`` only; the conv, the scan,
the decode kernel, the state layout and every other weight are SGLang's.

Under tensor parallelism ``x_proj`` is SGLang's ``RowParallelLinear`` (input sharded over
d_inner, output all-reduced), so dt/B/C and the three norms are full-size and replicated.

Import cost and platforms: SGLang's ``mamba1`` module imports ``einops`` (via its Triton ops)
and binds its causal-conv kernels only on CUDA, NPU and XPU; elsewhere importing it raises
``ImportError``. This module therefore only imports where SGLang's Mamba-1 mixer does; the model
module imports it when it builds a Mamba layer.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.mamba.mamba1 import MambaMixer1
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.quantization.base_config import QuantizationConfig

from marconi.integrations.sglang.jamba_config import JambaConfig


class JambaMambaMixer(MambaMixer1):
    """``MambaMixer1`` with Jamba's learned dt/B/C RMSNorms (same forward contract: called by
    SGLang's ``Mamba2AttnBackend.forward`` with the layer's ``MambaPool`` cache)."""

    def __init__(
        self,
        config: JambaConfig,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(
            hidden_size=config.hidden_size,
            intermediate_size=config.mamba_intermediate_size,
            state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
            time_step_rank=config.mamba_dt_rank,
            use_conv_bias=config.mamba_conv_bias,
            use_bias=config.mamba_proj_bias,
            activation=config.hidden_act,
            use_bc_dt_rms=False,
            quant_config=quant_config,
            prefix=prefix,
        )
        eps = config.rms_norm_eps
        self.dt_layernorm = RMSNorm(config.mamba_dt_rank, eps=eps)
        self.b_layernorm = RMSNorm(config.mamba_d_state, eps=eps)
        self.c_layernorm = RMSNorm(config.mamba_d_state, eps=eps)

    def _ssm_params(
        self, conv_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved x (tokens, d_inner/tp) -> (dt (tokens, d_inner/tp), B, C (tokens, d_state)),
        as transformers' ``JambaMambaMixer``: split ``x_proj``, RMSNorm each part (contiguous
        copies: SGLang's fused RMSNorm kernels want dense rows), then ``dt_proj`` (its bias is
        the time-step bias; softplus is applied by the scan / decode kernel)."""
        ssm_params, _ = self.x_proj(conv_out)
        time_step, b, c = torch.split(
            ssm_params,
            [self.time_step_rank, self.ssm_state_size, self.ssm_state_size],
            dim=-1,
        )
        time_step = self.dt_layernorm(time_step.contiguous())
        b = self.b_layernorm(b.contiguous())
        c = self.c_layernorm(c.contiguous())
        dt, _ = self.dt_proj(time_step)
        return dt, b, c

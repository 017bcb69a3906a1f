"""HybridMemory: the KV and SSM-state tensors behind the cache core's integer slot ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from marconi.cache.spec import CacheDtypes, ModelCacheSpec
from marconi.models.config import HybridConfig

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a cache dtype name (``float32``, ``bfloat16``, ``float16``)."""
    key = name.removeprefix("torch.")
    if key not in _TORCH_DTYPES:
        raise ValueError(f"unsupported cache dtype {name!r}; known: {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class StateSnapshot(NamedTuple):
    """A copy of one state slot: conv [L, K-1, C] and ssm [L, *state] over the L SSM layers."""

    conv: torch.Tensor
    ssm: torch.Tensor


def _index(slots: int | Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(slots, dtype=torch.long, device=device).reshape(-1)


class HybridMemory:
    """Owns `k`, `v` [attn_layers, num_kv_slots, kv_heads, head_dim] and `conv`
    [ssm_layers, num_state_slots, K-1, conv_dim], `ssm` [ssm_layers, num_state_slots, *state],
    shaped by the model's layer specs (``marconi.cache.spec``) in the given ``CacheDtypes``.

    A KV slot holds one token's K/V in every attention layer; a state slot holds one SSM
    checkpoint (conv + ssm state of every SSM layer). Slot ids come from the cache core's pools;
    this class never allocates or frees ids, it only stores. Its slot sizes are
    ``spec.kv_bytes_per_token(dtypes)`` and ``spec.state_bytes(dtypes)`` exactly.
    """

    def __init__(
        self,
        config: HybridConfig | ModelCacheSpec,
        num_kv_slots: int,
        num_state_slots: int,
        dtypes: CacheDtypes | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        spec = config.cache_spec if isinstance(config, HybridConfig) else config
        dtypes = dtypes or CacheDtypes("float32")
        self.spec, self.dtypes = spec, dtypes
        self.device = torch.device(device)
        self.num_kv_slots, self.num_state_slots = num_kv_slots, num_state_slots
        attn, mamba = spec.uniform()
        kv = (len(spec.attention), num_kv_slots, *(attn.slot_shape if attn else (0, 0)))
        dtype, state_dtype = torch_dtype(dtypes.kv), torch_dtype(dtypes.ssm)
        self.k = torch.zeros(kv, dtype=dtype, device=self.device)
        self.v = torch.zeros(kv, dtype=dtype, device=self.device)
        n = len(spec.mamba)
        conv_shape = mamba.conv_shape() if mamba else (0, 0)
        state_shape = mamba.state_shape if mamba else (0,)
        self.conv = torch.zeros(n, num_state_slots, *conv_shape, dtype=dtype, device=self.device)
        self.ssm = torch.zeros(
            n, num_state_slots, *state_shape, dtype=state_dtype, device=self.device
        )

    @property
    def kv_bytes_per_slot(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def state_bytes_per_slot(self) -> int:
        conv = self.conv[:, 0].numel() * self.conv.element_size()
        return conv + self.ssm[:, 0].numel() * self.ssm.element_size()

    def copy_state(self, src: int, dst: int) -> None:
        """Make state slot `dst` an independent copy of `src` (all SSM layers)."""
        self.copy_states([src], [dst])

    def copy_states(
        self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor
    ) -> None:
        """Batched copy_state; `dst` slots must be distinct."""
        s, d = _index(src, self.device), _index(dst, self.device)
        self.conv.index_copy_(1, d, self.conv.index_select(1, s))
        self.ssm.index_copy_(1, d, self.ssm.index_select(1, s))

    def zero_states(self, slots: int | Sequence[int] | torch.Tensor) -> None:
        i = _index(slots, self.device)
        self.conv.index_fill_(1, i, 0.0)
        self.ssm.index_fill_(1, i, 0.0)

    def read_state(self, slot: int) -> StateSnapshot:
        """A detached copy of state slot `slot` (e.g. for offloading or tests)."""
        return StateSnapshot(self.conv[:, slot].clone(), self.ssm[:, slot].clone())

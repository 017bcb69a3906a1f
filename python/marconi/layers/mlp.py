"""Feed-forward blocks: gated (SwiGLU style, fused gate+up) or plain (e.g. squared ReLU)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from marconi.layers.linear import Linear


def _relu2(x: torch.Tensor) -> torch.Tensor:
    y = F.relu(x)
    return y.mul_(y)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "relu2": _relu2,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called `name` in HF configs; ValueError if unknown."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; known: {sorted(_ACTIVATIONS)}"
        ) from None


class MLP(nn.Module):
    """`down(act(gate(x)) * up(x))` if `gated` (fused `gate_up`), else `down(act(up(x)))`.

    Parameters: `gate_up.weight` [2I, H] (gated) or `up.weight` [I, H]; `down.weight` [H, I].
    """

    def __init__(
        self, hidden: int, intermediate: int, act: str, gated: bool, bias: bool = False
    ) -> None:
        super().__init__()
        self.gated = gated
        self.intermediate = intermediate
        self.act = activation(act)
        if gated:
            self.gate_up = Linear(hidden, 2 * intermediate, bias=bias)
        else:
            self.up = Linear(hidden, intermediate, bias=bias)
        self.down = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            g, u = self.gate_up(x).split(self.intermediate, dim=-1)
            return self.down(self.act(g) * u)
        return self.down(self.act(self.up(x)))

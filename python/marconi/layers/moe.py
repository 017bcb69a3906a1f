"""Top-k mixture of experts with the three routers used by our hybrid families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from marconi.layers.mlp import MLP, activation

#: Router kinds: "softmax_topk" (Jamba: top-k of the softmax, not renormalised),
#: "topk_softmax" (Granite: softmax over the top-k logits),
#: "sigmoid_group" (Nemotron-H: sigmoid scores, bias-corrected grouped choice, renormalised).
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group")


class MoE(nn.Module):
    """Routed experts (+ an optional always-on shared MLP added to their output).

    Parameters: `router.weight` [E, H]; `experts_gate_up` [E, 2I, H] (gated) or `experts_up`
    [E, I, H]; `experts_down` [E, H, I]; `router_bias` [E] (sigmoid_group only); `shared.*`.
    No token is ever dropped (full capacity).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        act: str,
        gated: bool,
        router: str,
        shared_intermediate: int = 0,
        norm_topk: bool = True,
        routed_scaling: float = 1.0,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> None:
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; known: {ROUTERS}")
        self.num_experts, self.top_k, self.gated, self.router_kind = (
            num_experts,
            top_k,
            gated,
            router,
        )
        self.intermediate = intermediate
        self.norm_topk, self.routed_scaling = norm_topk, routed_scaling
        self.n_group, self.topk_group = n_group, topk_group
        self.act = activation(act)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        rows = 2 * intermediate if gated else intermediate
        if gated:
            self.experts_gate_up = nn.Parameter(torch.empty(num_experts, rows, hidden))
        else:
            self.experts_up = nn.Parameter(torch.empty(num_experts, rows, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        if router == "sigmoid_group":
            self.register_buffer("router_bias", torch.zeros(num_experts))
        self.shared = (
            MLP(hidden, shared_intermediate, act, gated) if shared_intermediate > 0 else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x.dtype, expert ids [T, k]) for tokens x [T, H]."""
        logits = F.linear(x.float(), self.router.weight.float())
        if self.router_kind == "softmax_topk":
            w, idx = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        elif self.router_kind == "topk_softmax":
            top, idx = logits.topk(self.top_k, dim=-1)
            w = torch.softmax(top, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores + self.router_bias.float()
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(min(2, e // self.n_group), dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group_scores)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], 1.0)
            mask = keep.bool().unsqueeze(-1).expand_as(grouped).reshape(t, e)
            idx = choice.masked_fill(~mask, float("-inf")).topk(self.top_k, dim=-1)[1]
            w = scores.gather(1, idx)
            if self.norm_topk:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * self.routed_scaling
        return w.to(x.dtype), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weights, idx = self.route(x2)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        out = torch.zeros_like(x2)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            toks = token_of[start : start + n]
            start += n
            h = x2.index_select(0, toks)
            if self.gated:
                g, u = F.linear(h, self.experts_gate_up[e]).split(self.intermediate, dim=-1)
                h = self.act(g) * u
            else:
                h = self.act(F.linear(h, self.experts_up[e]))
            h = F.linear(h, self.experts_down[e]) * weights.reshape(-1)[sel].unsqueeze(-1)
            out.index_add_(0, toks, h)
        if self.shared is not None:
            out = out + self.shared(x2)
        return out.view(shape)

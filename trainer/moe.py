"""A mixture-of-experts feed-forward in torchtitan's shapes: a top-k token-choice router, grouped
experts held as 3-D parameters, an optional shared expert, dropless dispatch.

Module names (relative to the block), torchtitan's and so the state dict's::

    moe.router.gate.weight          [num_experts, dim]
    moe.experts.w1 / w3             [num_experts, hidden, dim]   (nn.Linear's orientation per expert)
    moe.experts.w2                  [num_experts, dim, hidden]
    moe.shared_experts.w{1,2,3}.weight   (a SwiGLU, present with num_shared_experts > 0)

Routing (Mixtral's): softmax of the gate's logits in fp32, the ``top_k`` highest experts per token,
their scores renormalised to sum to 1; the block's output is the score-weighted sum of the chosen
experts' SwiGLUs (plus the shared expert). **Capacity: dropless** (torchtitan's default): every
token reaches its ``top_k`` experts however unevenly they are loaded; the expert batches are ragged
(the per-expert loop of :class:`GroupedExperts`), so no token is dropped or padded.

Load balancing: Switch Transformer's auxiliary loss ``num_experts * sum_e f_e * P_e`` (``f_e`` the
share of routed token slots expert ``e`` got, ``P_e`` its mean router probability; 1 when balanced),
left in :attr:`MoE.aux_loss` after each forward for the model to add (times its coefficient).

Expert parallel (:mod:`trainer.expert_parallel`) sets :attr:`MoE.dispatcher`: the sorted token
copies then go all-to-all to the ranks that own their experts and come back; without one, the local
experts run them. The experts' weights may be DTensors (sharded over the EP mesh): the local shard
is what runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def local(weight: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (autograd flows back into the DTensor), a plain tensor itself."""
    return weight.to_local() if hasattr(weight, "to_local") else weight


class TokenChoiceTopKRouter(nn.Module):
    """``x [tokens, dim]`` → ``(scores [tokens, k], experts [tokens, k], tokens_per_expert [E],
    aux_loss)``; the scores renormalised over the chosen k (see the module docstring)."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(self, x: torch.Tensor):
        probs = F.softmax(self.gate(x).float(), dim=-1)
        scores, experts = torch.topk(probs, self.top_k, dim=-1)
        scores = scores / scores.sum(dim=-1, keepdim=True)
        counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        share = counts.float() / max(1, experts.numel())  # f_e: no gradient (a count)
        aux = self.num_experts * (share * probs.mean(dim=0)).sum() if x.shape[0] else probs.sum() * 0
        return scores.type_as(x), experts, counts, aux

    def init_weights(self, std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=std)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLUs whose weights are stacked into 3-D parameters. ``forward(x, counts)``
    takes token rows sorted by expert and the row count of each (local) expert."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # the compute dtype of the tokens (bf16 under FSDP2's mixed precision; the experts, outside
        # FSDP2 under expert parallel, keep their fp32 masters and gradients)
        w1, w2, w3 = (local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        if len(counts) != w1.shape[0]:
            raise ValueError(f"{len(counts)} token counts for {w1.shape[0]} local experts")
        outs = [F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
                for e, rows in enumerate(torch.split(x, counts))]
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])

    def init_weights(self, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=out_std)


class MoE(nn.Module):
    """The block's feed-forward: ``x [b, s, dim]`` → ``[b, s, dim]``; :attr:`aux_loss` is this
    forward's load-balancing loss (a scalar with its graph)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int,
                 shared_experts: nn.Module | None = None):
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.shared_experts = shared_experts
        self.dispatcher = None  # trainer.expert_parallel.AllToAllDispatcher under expert parallel
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, experts, counts, self.aux_loss = self.router(flat)
        k = experts.shape[1]
        order = torch.argsort(experts.reshape(-1), stable=True)  # token slots grouped by expert
        routed = flat[order // k]
        if self.dispatcher is not None:
            out = self.dispatcher(self.experts, routed, counts)
        else:
            out = self.experts(routed, counts.tolist())
        slots = torch.zeros_like(out).index_copy(0, order, out).view(-1, k, shape[-1])
        y = (slots * scores.unsqueeze(-1)).sum(dim=1)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(shape)

    def init_weights(self, out_std: float) -> None:
        self.router.init_weights()
        self.experts.init_weights(out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std)


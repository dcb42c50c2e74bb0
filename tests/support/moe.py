"""The tests' yardstick for the mixture of experts: what :class:`trainer.moe.MoE` computes, token
by token with whole expert weights (no sorting, no dispatch, no capacity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _whole(weight: torch.Tensor) -> torch.Tensor:
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def dense_reference(moe, x: torch.Tensor) -> torch.Tensor:
    """``moe(x)`` computed per token: each token's chosen experts, weighted by its router scores."""
    flat = x.reshape(-1, x.shape[-1])
    scores, experts, _, _ = moe.router(flat)
    w1, w2, w3 = (_whole(w) for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
    rows = []
    for t in range(flat.shape[0]):
        row = flat.new_zeros(flat.shape[-1])
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            row = row + scores[t, j] * (w2[e] @ (F.silu(w1[e] @ flat[t]) * (w3[e] @ flat[t])))
        rows.append(row)
    y = torch.stack(rows)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(flat)
    return y.view(x.shape)

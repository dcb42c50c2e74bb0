"""Causal self-attention of the llama blocks over the whole sequence on this rank, and the interface a
sequence-sharded attention (:mod:`trainer.context_parallel`) implements.

Contract: an attention *core* is an object with two methods, called by
:class:`trainer.model.Attention` for every forward:

* ``positions(cos, sin, s)``: the rows of the full rotary tables (``[max_seq_len, head_dim // 2]``)
  for the ``s`` positions this rank holds, in the order it holds them;
* ``core(q, k, v, n_rep)``: ``q [b, s, heads, d]`` and ``k, v [b, s, kv_heads, d]`` (rotated) →
  ``[b, s, heads, d]``, each query attending causally to the keys at or before its position, every
  key/value head serving ``n_rep`` query heads (grouped-query attention).

:data:`WHOLE_SEQUENCE` is the core of an unsharded sequence: the first ``s`` rows, torch's causal
SDPA. It keeps no state and is shared by every block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, s, kv_heads, d]`` → ``[b, s, kv_heads * n_rep, d]``, each kv head repeated n_rep times."""
    if n_rep == 1:
        return x
    b, s, kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv, n_rep, d).reshape(b, s, kv * n_rep, d)


class WholeSequence:
    """The whole sequence on this rank (see the module docstring)."""

    def positions(self, cos: torch.Tensor, sin: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return cos[:s], sin[:s]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int) -> torch.Tensor:
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


WHOLE_SEQUENCE = WholeSequence()

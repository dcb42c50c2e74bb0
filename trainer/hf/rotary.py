"""The rotary q/k row permutation between our layout and Hugging Face's, and the per-tensor conversion.

Rotary convention. Our :func:`~trainer.rope.apply_rope` rotates *adjacent* pairs ``(x[2i], x[2i+1])``
of each head by angle ``i`` (Meta's interleaved, complex-number layout); Hugging Face's
``rotate_half`` rotates ``(x[i], x[i + head_dim/2])``. The two are the same function of the
weights once the output rows of ``wq`` and ``wk`` are permuted within each head: row ``2i + j``
(``j`` in 0, 1) of a head goes to row ``j * head_dim/2 + i`` (:func:`permute_to_hf`, the ``permute``
of transformers' ``convert_llama_weights_to_hf.py``; :func:`permute_from_hf` is its inverse). ``wq``
is permuted per query head, ``wk`` per key/value head (grouped-query attention); shapes are kept.

Contract: :func:`to_hf` / :func:`from_hf` convert one tensor (name and, for q/k, rows), so a
conversion streams one tensor at a time.
"""

from __future__ import annotations

import torch

from .names import OURS_LAYER, hf_name, our_name
from ..model import ModelArgs


def permute_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection from our interleaved rotary layout to Hugging Face's half-split
    one: within each of ``n_heads`` heads, row ``2i + j`` moves to ``j * head_dim/2 + i``."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def permute_from_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`permute_to_hf`."""
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _rotary_heads(key: str, args: ModelArgs) -> int | None:
    """How many heads the rows of ``key`` (ours) hold when it is a rotary projection, else None."""
    match = OURS_LAYER.match(key)
    if not match:
        return None
    return {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.kv_heads}.get(match.group(2))


def to_hf(key: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One of our weights → ``(Hugging Face key, tensor)``; q/k rows permuted (same shape, a new
    tensor), every other tensor returned as is."""
    name = hf_name(key)
    heads = _rotary_heads(key, args)
    return name, tensor if heads is None else permute_to_hf(tensor, heads)


def from_hf(hf_key: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, torch.Tensor]:
    """One Hugging Face ``LlamaForCausalLM`` weight → ``(our key, tensor)``; the inverse of :func:`to_hf`."""
    key = our_name(hf_key)
    heads = _rotary_heads(key, args)
    return key, tensor if heads is None else permute_from_hf(tensor, heads)

"""Our llama's state-dict keys ↔ torchtitan 0.3.0's llama3 (``torchtitan.models.llama3``), and its fused q/k/v.

torchtitan's model state dict (what its ``ModelWrapper`` saves, flat at the checkpoint's top level)
holds the split views its ``FusedQKVLinear`` state-dict hook makes of the one ``wqkv`` parameter;
its optimizer state is keyed by *parameter* name, so there the projection is the fused one::

    ours (no "model." prefix)                  torchtitan: model state          torchtitan: parameter (optimizer)
    tok_embeddings.weight                      tok_embeddings.weight            (same)
    layers.N.attention.{wq,wk,wv}.weight       layers.N.attention.qkv_linear.{wq,wk,wv}.weight
                                                                                 layers.N.attention.qkv_linear.wqkv.weight
    layers.N.attention.wo.weight               (same)                           (same)
    layers.N.feed_forward.{w1,w2,w3}.weight    (same)                           (same)
    layers.N.{attention_norm,ffn_norm}.weight  (same)                           (same)
    norm.weight                                (same)                           (same)
    output.weight                              lm_head.weight                   lm_head.weight

The fused rows are grouped per key/value head: ``wqkv.reshape(n_kv_heads, q_per_kv + 2, head_dim,
dim)`` holds each group's ``q_per_kv`` query heads, then its key head, then its value head (torchtitan's
``_split_qkv_on_save`` / ``_merge_qkv_on_load``); :func:`split_qkv` and :func:`fuse_qkv` are those two,
for any tensor shaped like the weight (the optimizer's moments). Both rotary layouts are the same
(adjacent pairs, Meta's): no q/k permutation.

Contract: :func:`titan_name` / :func:`our_name` are inverse bijections on the model state's keys
(KeyError for anything else); :func:`titan_param` / :func:`params_of` map our parameter names to
torchtitan's parameter names (three of ours to one fused).
"""

from __future__ import annotations

import re

import torch

_OURS = re.compile(r"^layers\.(\d+)\.attention\.(wq|wk|wv)\.weight$")
_TITAN = re.compile(r"^layers\.(\d+)\.attention\.qkv_linear\.(wq|wk|wv)\.weight$")
_FUSED = re.compile(r"^layers\.(\d+)\.attention\.qkv_linear\.wqkv\.weight$")
_SAME = re.compile(r"^(tok_embeddings\.weight|norm\.weight|layers\.\d+\.(attention\.wo|feed_forward\.w[123]|"
                   r"attention_norm|ffn_norm)\.weight)$")
QKV = ("wq", "wk", "wv")


def titan_name(key: str) -> str:
    """Our model key → torchtitan's model state key."""
    if key == "output.weight":
        return "lm_head.weight"
    match = _OURS.match(key)
    if match:
        return f"layers.{match.group(1)}.attention.qkv_linear.{match.group(2)}.weight"
    if _SAME.match(key):
        return key
    raise KeyError(f"{key!r} is not a weight of our llama (no torchtitan name)")


def our_name(key: str) -> str:
    """torchtitan's llama3 model state key → ours."""
    if key == "lm_head.weight":
        return "output.weight"
    match = _TITAN.match(key)
    if match:
        return f"layers.{match.group(1)}.attention.{match.group(2)}.weight"
    if _SAME.match(key):
        return key
    raise KeyError(f"{key!r} is not a torchtitan llama3 weight our llama has")


def titan_param(key: str) -> str:
    """Our parameter name → torchtitan's parameter name (``wq``/``wk``/``wv`` → the fused ``wqkv``)."""
    match = _OURS.match(key)
    if match:
        return f"layers.{match.group(1)}.attention.qkv_linear.wqkv.weight"
    return titan_name(key)


def params_of(titan: str) -> tuple[str, ...]:
    """torchtitan's parameter name → ours (three, wq/wk/wv, for a fused ``wqkv``)."""
    match = _FUSED.match(titan)
    if match:
        return tuple(f"layers.{match.group(1)}.attention.{p}.weight" for p in QKV)
    return (our_name(titan),)


def split_qkv(fused: torch.Tensor, n_heads: int, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tensor shaped like ``wqkv`` → ``(wq, wk, wv)``-shaped tensors (new, contiguous)."""
    per_kv = n_heads // n_kv_heads
    head_dim = fused.shape[0] // (n_kv_heads * (per_kv + 2))
    if fused.shape[0] != n_kv_heads * (per_kv + 2) * head_dim:
        raise ValueError(f"a fused q/k/v of {fused.shape[0]} rows does not split into {n_heads} query and "
                         f"{n_kv_heads} key/value heads")
    tail = tuple(fused.shape[1:])
    w = fused.reshape(n_kv_heads, per_kv + 2, head_dim, *tail)
    return (w[:, :per_kv].reshape(-1, *tail).contiguous(), w[:, per_kv].reshape(-1, *tail).contiguous(),
            w[:, per_kv + 1].reshape(-1, *tail).contiguous())


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """The inverse of :func:`split_qkv`."""
    head_dim = k.shape[0] // n_kv_heads
    tail = tuple(q.shape[1:])
    parts = (q.reshape(n_kv_heads, n_heads // n_kv_heads, head_dim, *tail),
             k.reshape(n_kv_heads, 1, head_dim, *tail), v.reshape(n_kv_heads, 1, head_dim, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail).contiguous()

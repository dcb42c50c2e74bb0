"""The language-model loss: next-token cross-entropy over the output projection, without the whole
vocabulary's logits on every rank.

Contract: :func:`lm_loss` takes the final norm's hidden states ``h`` (``[b, s, dim]``, plain or a
sequence-sharded DTensor under tensor parallelism), the output projection and the labels ``[b, s]``
and returns the mean loss as a plain fp32 scalar (equal to ``F.cross_entropy(output(h).flatten(0,
1).float(), labels.flatten())`` up to the summation order). Two things keep the logits small:

* **loss parallel** (tensor parallelism): the output projection leaves its logits sharded by
  vocabulary (a DTensor, ``Shard(-1)``, :func:`trainer.parallel.apply_tp`) and the cross-entropy
  runs on the shards under ``torch.distributed.tensor.parallel.loss_parallel`` (a max and a sum of
  exponentials all-reduced over TP), never gathering them: a rank holds ``V/tp`` of each token's
  logits. :func:`loss_context` is that context; forward *and* backward must run inside it.
* **chunked loss** (``chunk_len`` > 0 and shorter than the sequence): the sequence is cut into
  chunks of ``chunk_len`` positions; each chunk's logits are computed, reduced to a summed loss and
  freed, under ``torch.utils.checkpoint`` (non-reentrant), so backward recomputes them one chunk at
  a time. What stays is the hidden states (held anyway); the price is one more forward of the
  output projection (2·h·V FLOPs a token, ~0.5 % of a 70B step). ``chunk_len`` 0, or a sequence no
  longer than it, is the one-shot path: the logits of the whole microbatch at once.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def loss_context(enabled: bool):
    """``loss_parallel()`` when the logits are vocabulary-sharded DTensors, else a no-op context."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a replicated DTensor; the rest of the step wants a tensor."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction)


def _chunk_loss(output: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return _cross_entropy(output(h), labels, "sum")


def lm_loss(h: torch.Tensor, output: nn.Module, labels: torch.Tensor, chunk_len: int = 0) -> torch.Tensor:
    """The mean next-token loss of ``output(h)`` against ``labels`` (see the module docstring)."""
    s = labels.shape[1]
    if chunk_len <= 0 or s <= chunk_len:
        return _plain(_cross_entropy(output(h), labels, "mean"))
    from torch.utils.checkpoint import checkpoint

    if hasattr(h, "redistribute"):  # sequence-sharded: the projection needs whole chunks of the sequence
        from torch.distributed.tensor import Replicate

        h = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
    total = None
    for start in range(0, s, chunk_len):
        end = min(s, start + chunk_len)
        part = checkpoint(_chunk_loss, output, h[:, start:end], labels[:, start:end],
                          use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return _plain(total) / labels.numel()

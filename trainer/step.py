"""One training step: the micro-steps' forward and backward, then clipping and the optimizer step.

Contract: :func:`forward_backward` runs a step's per-rank batch (``micro_batch x accumulation``
sequences) through the model, or through the pipeline's schedule, and leaves the gradients of the
mean loss (times ``scale``, the fp16 loss scale) in the parameters; it returns the mean loss. The
loss is computed inside the model (:func:`trainer.loss.lm_loss`), under ``loss_parallel`` when the
logits are vocabulary-sharded. ``sync_every_micro_step``: FSDP2 reduce-scatters every micro-step
(sharded accumulation) instead of only the last one. :func:`optimizer_step` unscales (fp16),
clips over the whole model (all pipeline stages) and steps, or skips the step on an overflow; it
returns the gradients' norm before clipping (the metrics' ``grad_norm``), a tensor left on the
device (a DTensor under FSDP2/TP: :func:`norm_value` makes it a number, collectively).
The trainer (:mod:`trainer.train`) and the measured dry run (:mod:`trainer.measure`) both run these,
so what is measured is what trains.
"""

from __future__ import annotations

import contextlib

import torch

from . import pipeline as pipeline_mod
from .loss import loss_context
from .parallel import set_gradient_sync


def forward_backward(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *,
                     pipeline: pipeline_mod.Pipeline | None, micro_batch: int, accumulation: int,
                     sync_every_micro_step: bool, loss_parallel: bool, autocast=None,
                     scale: float = 1.0, after_backward=None) -> torch.Tensor:
    """Forward and backward of one step's per-rank batch (see the module docstring); the mean loss.
    ``after_backward()`` runs once after the last micro-step (expert parallel's gradient sync)."""
    autocast = autocast if autocast is not None else contextlib.nullcontext()
    with loss_context(loss_parallel):
        if pipeline is not None:  # the whole per-rank batch, in the schedule's microbatches
            with autocast:
                return pipeline.step(inputs, labels, loss_scale=scale)
        total = torch.zeros((), device=inputs.device)
        for micro in range(accumulation):
            chunk = slice(micro * micro_batch, (micro + 1) * micro_batch)
            last = micro == accumulation - 1
            with set_gradient_sync(model, last or sync_every_micro_step), autocast:
                loss = model(inputs[chunk], labels=labels[chunk])
                (loss * (scale / accumulation)).backward()
            total += loss.detach() / accumulation
        if after_backward is not None:
            after_backward()
        return total


def optimizer_step(parameters: list[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler, *,
                   max_norm: float, scaler=None, pp_group=None, clip_grad_norm=None) -> torch.Tensor | None:
    """Unscale (fp16), clip over the whole model, step — or skip the step on an fp16 overflow.
    ``clip_grad_norm(parameters, max_norm)`` replaces torch's clipping (expert parallel's two meshes).
    Returns the norm the clipping computed; None when nothing was clipped (``max_norm`` 0, an overflow)."""
    overflow = scaler is not None and scaler.unscale_(parameters)
    norm = None
    if max_norm > 0 and not overflow:
        if clip_grad_norm is not None:
            norm = clip_grad_norm(parameters, max_norm)
        elif pp_group is not None:
            norm = pipeline_mod.clip_grad_norm(parameters, max_norm, pp_group)
        else:
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    if not overflow:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.update(overflow)
    return norm


def norm_value(norm: torch.Tensor | None) -> float | None:
    """``optimizer_step``'s norm as a number (None stays None). A DTensor's (FSDP2/TP gradients: a
    partial norm) is reduced over its mesh first, so every rank must call this at the same step."""
    if norm is None:
        return None
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)

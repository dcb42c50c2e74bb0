"""Pipeline parallelism through ``torch.distributed.pipelining``: stages, schedules, one training step.

The model is built whole (on every rank, from the same seed, so weights equal a one-process run's),
then cut into ``pp × virtual_stages`` stages of consecutive layers: the first stage keeps the
embedding, the last the final norm and output projection (``trainer.model`` passes hidden states
through a stage without them). Rank ``r`` of the pipeline group holds stages ``r, r + pp, ...``
(the "loop" placement interleaved schedules expect). Each part is then parallelized like a whole
model (TP → activation checkpointing → compile → FSDP2).

Schedules (``parallelism.pp_schedule``): ``gpipe``, ``1f1b`` (one stage per rank) and
``interleaved1f1b`` (``pp_virtual_stages`` ≥ 2 stages per rank); the batch of a step is split into
``pp_microbatches`` (≥ pp for 1F1B to fill the pipeline). Gradients are averaged over microbatches
by the schedule, so a step's gradient is the batch mean, as without a pipeline. The last stage owns
the loss: it is given the labels (a keyword argument of the schedule, split into microbatches like
the inputs) and returns the loss itself (:func:`trainer.loss.lm_loss`: loss parallel, chunked), so
no logits cross a stage boundary; :meth:`Pipeline.step` sums it over the pipeline group so every
rank reports the same value.

Every stage is given its input and output shapes (:func:`stage_io`: the token ids, the hidden
states ``[microbatch, s/tp, dim]`` in the activations' dtype, the scalar loss), so the schedule
needs no shape inference (which would run an extra forward and backward through the pipeline on
the first step). With FSDP2, :class:`Stage` reduce-scatters every microbatch's gradients (FSDP2's
default) unless ``accumulate_unsharded`` (:func:`trainer.parallel.accumulates_unsharded`) asks for
torch's own choice, whole gradients kept until the last microbatch.

:class:`ModelParts` is one module over the parts this rank holds, with the whole model's attribute
names (``layers.<global index>``, ``tok_embeddings``, ``norm``, ``output``). The optimizer runs over its
parameters and the checkpoint saves it, so state-dict keys (model and optimizer) are the same
canonical names with or without a pipeline: a pipelined run's checkpoint loads into any other layout.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .parallel import ParallelismError

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The stage indices rank ``pp_rank`` holds (loop placement)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


def microbatch_count(pp_microbatches: int | None, accumulation: int, pp: int) -> int:
    """The microbatches a step's per-rank batch (micro x accumulation sequences) goes through the
    schedule in: ``parallelism.pp_microbatches``, else the accumulation's micro-batches, else pp
    (the least that fills the pipeline)."""
    return pp_microbatches or (accumulation if accumulation > 1 else pp)


def layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Consecutive layers per stage, the first stages taking one more when they do not divide."""
    if n_layers < n_stages:
        raise ParallelismError(f"model.n_layers = {n_layers} cannot fill {n_stages} pipeline stages")
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for stage in range(n_stages):
        size = base + (stage < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def split_model(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of ``model`` holding only what stage ``stage`` of ``n_stages`` computes."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layer_ranges(len(model.layers), n_stages)[stage]}
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


class ModelParts(nn.Module):
    """The parts one rank holds, as one module with the whole model's names (see module docstring)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict({name: layer for part in parts for name, layer in part.layers.items()})
        for attr in ("tok_embeddings", "norm", "output"):
            owner = [getattr(part, attr) for part in parts if getattr(part, attr) is not None]
            if owner:
                setattr(self, attr, owner[0])
        object.__setattr__(self, "parts", parts)  # not a child: its names would prefix the keys

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through Pipeline.step, not forward()")


def __getattr__(name: str):
    if name == "Stage":  # ``trainer.pipeline.Stage`` as before, made on first use (see stage_class)
        return stage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def stage_class() -> type:
    """The :class:`Stage` class, defined on first use: ``torch.distributed.pipelining`` imports
    ``torch._dynamo`` (~1 s of CPU), which a run without a pipeline never needs (tests/test_import_cost.py)."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        """A ``PipelineStage`` whose FSDP2 module reduce-scatters its gradients after every microbatch
        (``sharded_accumulation``) instead of torch's no-sync accumulation of whole gradients; the
        schedule's final reduce step then only finishes the root's (embedding/norm/output) reduction."""

        def __init__(self, *args, sharded_accumulation: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.sharded_accumulation = sharded_accumulation

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
            from torch.distributed.fsdp import FSDPModule

            if not (self.sharded_accumulation and backward_type == "full" and isinstance(self.submod, FSDPModule)):
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            from torch.distributed.pipelining._backward import stage_backward

            self.submod.set_is_last_backward(False)  # as torch does: the schedule's reduce step ends the step
            self.submod.set_reshard_after_backward(False)
            self.submod.set_requires_gradient_sync(True)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
            return grads, None

    Stage.__qualname__ = Stage.__name__ = "Stage"
    Stage.__module__ = __name__
    return Stage


def stage_io(stage: int, n_stages: int, *, microbatch: int, seq_len: int, dim: int, tp: int, tp_rank: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) examples of a stage on the meta device: the first takes token ids
    ``[microbatch, seq_len]``, the others hidden states ``[microbatch, s_local, dim]`` in ``dtype``
    (``s_local``: this TP rank's share of the sequence, as DTensor's Shard(1) cuts it); the last
    returns the scalar fp32 loss, the others hidden states (all but the ids with gradients: the
    schedule sends a gradient back only for an output that requires one)."""
    chunk = -(-seq_len // tp)
    local = max(0, min(chunk, seq_len - tp_rank * chunk))
    hidden = torch.empty(microbatch, local, dim, dtype=dtype, device="meta", requires_grad=True)
    inputs = torch.empty(microbatch, seq_len, dtype=torch.long, device="meta") if stage == 0 else hidden
    outputs = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True) if stage == n_stages - 1 else hidden
    return inputs, outputs


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, parts: list[nn.Module], stages: list[int], n_stages: int, *, schedule: str,
                 microbatches: int, device: torch.device, group: dist.ProcessGroup, io: Callable,
                 sharded_accumulation: bool = False):
        from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.group, self.device, self.loss_scale = group, device, 1.0
        self.is_first, self.is_last = 0 in stages, n_stages - 1 in stages
        pipeline_stages, stage = [], stage_class()
        for part, index in zip(parts, stages):
            inputs, outputs = io(index)
            pipeline_stages.append(stage(part, index, n_stages, device, input_args=inputs, output_args=outputs,
                                         group=group, sharded_accumulation=sharded_accumulation))
        if schedule == "interleaved1f1b":
            if len(stages) < 2:
                raise ParallelismError("parallelism.pp_schedule = interleaved1f1b needs pp_virtual_stages >= 2")
            self.schedule = ScheduleInterleaved1F1B(pipeline_stages, microbatches, loss_fn=self._scaled_loss)
        else:
            if len(stages) != 1:
                raise ParallelismError(f"parallelism.pp_schedule = {schedule} runs one stage per rank; "
                                       "set pp_virtual_stages = 1 (or use interleaved1f1b)")
            single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
            self.schedule = single(pipeline_stages[0], microbatches, loss_fn=self._scaled_loss)

    def _scaled_loss(self, loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale  # the last stage's output is already its microbatch's loss

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, *, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline, the gradients being those of the
        loss times ``loss_scale`` (the fp16 scale, over the accumulation steps); returns the batch's
        mean loss (unscaled) on every rank of the pipeline group."""
        self.loss_scale = loss_scale
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        extra = {"labels": labels} if self.is_last else {}
        self.schedule.step(*args, target=labels if self.is_last else None, losses=losses, return_outputs=False, **extra)
        loss = (torch.stack(losses).mean().detach() / loss_scale if self.is_last
                else torch.zeros((), device=self.device))
        dist.all_reduce(loss, group=self.group)  # only the last stage's is non-zero
        return loss


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float,
                   pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """``clip_grad_norm_`` over the whole model when its parameters are spread over pipeline stages:
    the squared norms of the stages are summed over ``pp_group`` first. Returns the norm (before clipping)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor gradients (FSDP2, TP)
        norm = norm.full_tensor()
    if pp_group is not None:
        norm = norm ** 2
        dist.all_reduce(norm, group=pp_group)
        norm = norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)
    return norm


def build(model: nn.Module, parallelize: Callable[[nn.Module], nn.Module], mesh, *, pp: int, virtual_stages: int,
          schedule: str, pp_microbatches: int | None, micro_batch: int, accumulation: int, dp: int, zero_stage: int,
          device: torch.device, seq_len: int, activation_dtype: torch.dtype,
          sharded_accumulation: bool = False) -> tuple[Pipeline, ModelParts]:
    """This rank's stages of ``model`` (its index in ``mesh``'s ``pp`` dimension), each part
    parallelized by ``parallelize`` like a whole model, as a :class:`Pipeline` and the
    :class:`ModelParts` over them. A step's whole per-rank batch (``micro_batch x accumulation``
    sequences of ``seq_len`` tokens) runs in one schedule, in :func:`microbatch_count` microbatches,
    the hidden states between stages in ``activation_dtype``; ParallelismError when they do not
    divide it, or for DDP (``zero_stage`` 0 with ``dp`` > 1), which cannot wrap stages."""
    if zero_stage == 0 and dp > 1:
        raise ParallelismError("zero_stage 0 (DDP) cannot wrap pipeline stages; use zero_stage >= 1")
    per_rank = micro_batch * accumulation
    microbatches = microbatch_count(pp_microbatches, accumulation, pp)
    if per_rank % microbatches:
        raise ParallelismError(
            f"the per-rank batch of a step ({per_rank} sequences) is not divisible by the pipeline's "
            f"{microbatches} microbatches (parallelism.pp_microbatches)")
    n_stages = pp * virtual_stages
    stages = stage_ids(mesh.get_local_rank("pp"), pp, virtual_stages)
    parts = [parallelize(split_model(model, stage, n_stages)) for stage in stages]
    tp = mesh["tp"].size()
    io = lambda stage: stage_io(stage, n_stages, microbatch=per_rank // microbatches, seq_len=seq_len,  # noqa: E731
                                dim=model.args.dim, tp=tp, tp_rank=mesh.get_local_rank("tp"), dtype=activation_dtype)
    pipe = Pipeline(parts, stages, n_stages, schedule=schedule, microbatches=microbatches, device=device,
                    group=mesh["pp"].get_group(), io=io, sharded_accumulation=sharded_accumulation)
    return pipe, ModelParts(parts)

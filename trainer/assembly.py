"""The model as a run trains it: its dtype, loss chunking, and its parallel wrapping or pipeline stages.

Contract: :func:`assemble` takes a built model (initialised, or on the meta device for the
measured dry run), the configuration and this rank's mesh, and returns an :class:`Assembled`: the
model to train (or the :class:`~trainer.pipeline.ModelParts` of this rank's stages and their
:class:`~trainer.pipeline.Pipeline`) and the step's switches (loss parallel, sharded accumulation,
autocast). The trainer (:mod:`trainer.train`) and the measured dry run (:mod:`trainer.measure`)
both assemble through here, so what is measured is the layout that trains. Order: parameters cast
to ``optimization.master_dtype``, then :func:`trainer.parallel.parallelize` (TP → AC → compile →
FSDP2/DDP) per model or per pipeline part.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from . import expert_parallel
from . import model as model_mod
from . import pipeline as pipeline_mod
from .parallel import COMPUTE_DTYPES, ParallelDims, accumulates_unsharded, parallelize, uses_autocast


@dataclass
class Assembled:
    model: nn.Module  # what the optimizer and the checkpoint see (ModelParts under a pipeline)
    pipeline: pipeline_mod.Pipeline | None
    loss_parallel: bool  # logits vocabulary-sharded into the loss (tp > 1 and optimization.loss_parallel)
    sync_every_micro_step: bool  # FSDP2 reduce-scatters every micro-step (sharded accumulation)
    autocast: bool  # bf16/fp16 through autocast (no FSDP2 mixed precision)
    low_dtype: torch.dtype | None  # the compute dtype; None for fp32
    param_dtype: torch.dtype  # the stored parameters' (master weights') dtype
    after_backward: Callable[[], None] | None = None  # expert parallel: the experts' gradient sync
    clip_grad_norm: Callable | None = None  # expert parallel: clipping over the FSDP2 and EP meshes

    @property
    def roots(self) -> list[nn.Module]:
        """The wrapped roots: the model, or each pipeline part."""
        return list(self.model.parts) if self.pipeline is not None else [self.model]


def activation_dtype(low: torch.dtype | None, dp: int, param_dtype: torch.dtype) -> torch.dtype:
    """The hidden states' dtype between pipeline stages: the compute dtype under FSDP2's mixed
    precision (dp > 1) or with bf16 parameters; fp32 otherwise (autocast keeps the residual fp32)."""
    return low if low is not None and (dp > 1 or param_dtype != torch.float32) else torch.float32


def assemble(cfg, model: model_mod.Transformer, dims: ParallelDims, mesh, device: torch.device, *,
             micro_batch: int, accumulation: int) -> Assembled:
    """``model`` cast, chunked and wrapped for ``dims`` (see the module docstring)."""
    o, p = cfg.optimization, cfg.parallelism
    param_dtype = torch.bfloat16 if o.master_dtype == "bf16" else torch.float32
    model_mod.cast_parameters(model, param_dtype)
    model.loss_chunk_len = o.loss_chunk_len
    low = COMPUTE_DTYPES[o.precision]
    sharded = not accumulates_unsharded(o.zero_stage, o.accumulate_unsharded)
    ep = getattr(p, "ep", 1)
    if model.args.is_moe and (dims.tp > 1 or dims.pp > 1):
        raise expert_parallel.ParallelismError(
            f"a mixture-of-experts model does not compose with parallelism.tp = {dims.tp} / pp = {dims.pp} above 1 yet")
    expert_parallel.check(ep, num_experts=model.args.num_experts, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp,
                          zero_stage=o.zero_stage, cp=dims.cp)
    ignored, after_backward, clip = None, None, None
    if ep > 1:
        ep_mesh = expert_parallel.build_mesh(mesh.device_type, pp=dims.pp, dp_replicate=dims.dp_replicate,
                                             dp_shard=dims.dp_shard, ep=ep, tp=dims.tp)
        expert_parallel.apply(model, ep_mesh)
        experts = expert_parallel.expert_params(model)
        ignored = set(experts)
        after_backward = partial(expert_parallel.sync_grads, experts, expert_parallel.replica_group(ep_mesh), dims.dp)
        clip = expert_parallel.clip_grad_norm_

    def wrap(module: nn.Module) -> nn.Module:
        return parallelize(module, dims, mesh, zero_stage=o.zero_stage, precision=o.precision,
                           activation_checkpointing=o.gradient_checkpointing, compile=o.compile, device=device,
                           ac_every=o.ac_every, ac_op_level=o.ac_op_level, cpu_offload=o.cpu_offload,
                           loss_parallel=o.loss_parallel, ignored_params=ignored)

    pipeline = None
    if dims.pp > 1:
        pipeline, wrapped = pipeline_mod.build(
            model, wrap, mesh, pp=p.pp, virtual_stages=p.pp_virtual_stages, schedule=p.pp_schedule,
            pp_microbatches=p.pp_microbatches, micro_batch=micro_batch, accumulation=accumulation, dp=dims.dp,
            zero_stage=o.zero_stage, device=device, seq_len=cfg.training.seq_len,
            activation_dtype=activation_dtype(low, dims.dp, param_dtype), sharded_accumulation=sharded)
        autocast_root = wrapped.parts[0]
    else:
        wrapped = autocast_root = wrap(model)
    return Assembled(model=wrapped, pipeline=pipeline, loss_parallel=dims.tp > 1 and o.loss_parallel,
                     sync_every_micro_step=sharded, autocast=low is not None and uses_autocast(autocast_root),
                     low_dtype=low, param_dtype=param_dtype, after_backward=after_backward, clip_grad_norm=clip)

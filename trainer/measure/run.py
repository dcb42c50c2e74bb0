"""One real training step of a layout at its full world size, in this process, its memory measured.

Contract: :func:`measure` plays one rank of ``world_size`` (the first rank of a pipeline stage: the
fullest, as uneven shards give it the larger piece): a fake process group (``FakeStore``, backend
"fake": every collective returns at once with tensors of the right shapes), the model built on the
meta device and assembled exactly as the trainer does (:func:`trainer.assembly.assemble`), its
storage materialised under ``FakeTensorMode`` (shapes and dtypes, no bytes), the optimizer's state
made by one step on zero gradients (the steady state: a real run's first step has none yet), then
one step of :mod:`trainer.step` (every micro-step or the pipeline schedule, clipping, AdamW) under
:class:`~trainer.measure.tracker.StepTracker`. It returns the peak of the tensors alive, by category.

What a fake device cannot show: the allocator (caching, fragmentation, a few % to 10 % on a GPU),
the runtime's own memory (CUDA/CANN context, NCCL/HCCL buffers), the CUDA path's stream
bookkeeping (FSDP2 keeps an all-gather or reduce-scatter buffer a little longer on a GPU), and
torch.compile (blocks run eagerly here). A mixture of experts is refused: its expert batches are
data-dependent shapes. The pipeline's shape exchange and its start-up vote need
real point-to-point messages; the stages are given their shapes (:func:`trainer.pipeline.stage_io`)
and the vote's only possible outcome, static shapes, is set directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import model as model_mod
from .. import optim as optim_mod
from .. import step as step_mod
from ..assembly import assemble
from .tracker import StepTracker, peak, untracked_propagation
from ..parallel import ParallelDims, ParallelismError
from ..plan.layout import resolve_layout
from ..plan.params import model_args_for


@dataclass
class Measured:
    """One rank's measured step."""

    stage: int
    rank: int
    peak: int  # bytes
    breakdown: dict[str, int] = field(default_factory=dict)  # MemTracker's categories at the peak
    seconds: float = 0.0


def _static_pipeline(pipeline) -> None:
    """Every stage was given its shapes: the vote (real point-to-point) can only say "static"."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    pipeline.schedule._warmup_p2p = warmup


def measure(cfg, world_size: int, stage: int = 0) -> Measured:
    """The measured peak of pipeline stage ``stage``'s first rank (see the module docstring)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    args = model_args_for(cfg)
    if args.is_moe:
        raise ParallelismError("--measure cannot step a mixture of experts: how many tokens each expert gets "
                               "depends on the routing, values a fake device does not have; --dry-run alone plans it")
    lay = resolve_layout(cfg, world_size, args)  # refuses what the trainer and the plan refuse
    micro, accumulation = cfg.resolve_batch(lay.dp)
    rank = stage * (world_size // lay.pp)
    if dist.is_initialized():
        raise RuntimeError("a measured dry run plays its own ranks: no process group may be running")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        return _step(cfg, lay, args, rank, stage, micro, accumulation)
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """DTensor caches sharding decisions by mesh, and a mesh of the next role (another rank, new
    process groups) compares equal to this one's: clear them, or the next role's ops would name
    this role's destroyed groups."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    _gen_transform_infos.cache_clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()


def _step(cfg, lay, args, rank: int, stage: int, micro: int, accumulation: int) -> Measured:
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.perf_counter()
    dims = ParallelDims(lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.world_size, lay.cp)
    mesh = dims.build_mesh("cpu")  # outside the fake mode: the mesh's own tensors are real
    device = torch.device("cpu")
    with torch.device("meta"):
        model = model_mod.Transformer(args)
    run = assemble(cfg, model, dims, mesh, device, micro_batch=micro, accumulation=accumulation)
    if run.pipeline is not None:
        _static_pipeline(run.pipeline)
    t, o = cfg.training, cfg.optimization
    with FakeTensorMode(allow_non_fake_inputs=True):
        for root in run.roots:
            root.to_empty(device=device)
        params = list(run.model.parameters())
        optimizer = optim_mod.build(params, lr=t.lr, weight_decay=t.weight_decay, state_dtype=o.optimizer_state_dtype,
                                    param_dtype=run.param_dtype, seed=cfg.job.seed, rank=rank)
        for p in params:  # the optimizer state, as after the first step
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        shape = (micro * accumulation, t.seq_len // lay.cp)  # a CP rank's share of each sequence
        inputs = torch.randint(0, args.vocab_size, shape, device=device)
        labels = torch.randint(0, args.vocab_size, shape, device=device)
        tracker = StepTracker()
        tracker.track_external(run.model, optimizer, inputs, labels)
        autocast = torch.autocast("cpu", dtype=run.low_dtype or torch.bfloat16, enabled=run.autocast)
        with untracked_propagation(tracker), tracker:
            step_mod.forward_backward(run.model, inputs, labels, pipeline=run.pipeline, micro_batch=micro,
                                      accumulation=accumulation, sync_every_micro_step=run.sync_every_micro_step,
                                      loss_parallel=run.loss_parallel, autocast=autocast)
            step_mod.optimizer_step(params, optimizer, None, max_norm=t.max_norm,
                                    pp_group=mesh["pp"].get_group() if run.pipeline is not None else None)
    total, breakdown = peak(tracker)
    return Measured(stage=stage, rank=rank, peak=total, breakdown=breakdown,
                    seconds=time.perf_counter() - started)

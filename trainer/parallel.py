"""Parallel layout: the device mesh (pp × dp_replicate × dp_shard × cp × tp) and how the model is wrapped.

Order of application (torchtitan's): tensor parallel → activation checkpointing → compile →
data parallel (FSDP2/HSDP, or DDP for zero_stage 0). ``zero_stage``: 0 → DDP; 1 and 2 → FSDP2
keeping parameters unsharded after forward (ZeRO-2-like); 3 → FSDP2 resharding after forward.
With one data-parallel rank there is nothing to shard or replicate, so the model is not wrapped at
all (as in torchtitan): FSDP2 on a 1-rank mesh still copies every parameter in and out of its flat
buffers and runs the optimizer on DTensors, +10-30% time per step on CPU (benchmarks/RESULTS.md).
Checkpoints do not care: plain tensors and DTensor shards load into each other by FQN.
With ``precision = "bf16"`` FSDP2 computes in bf16 and reduces gradients in fp32 (master weights
and optimizer state stay fp32); DDP and the unwrapped model use autocast. Tensor parallelism
(``apply_tp``) is Megatron-style with sequence parallelism; FSDP2 then shards the TP DTensors over
the data-parallel dimensions (2-D), HSDP when ``dp_replicate > 1``. Context parallelism (``cp``,
:mod:`trainer.context_parallel`) splits every sequence over the ``cp`` dimension; its ranks hold the
same samples, so FSDP2 shards (and averages gradients) over ``dp_shard × cp`` flattened
(``dp_shard_cp``, torchtitan's name) and the data loader shards over ``dp_replicate × dp_shard``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .context_parallel import apply_cp


class ParallelismError(ValueError):
    """The requested parallel layout does not fit the world size or is not supported yet."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, tp: int, pp: int, world_size: int,
                cp: int = 1) -> "ParallelDims":
        for name, value in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", pp), ("cp", cp)):
            if value < 1:
                raise ParallelismError(f"parallelism.{name} must be >= 1, got {value}")
        if cp > 1 and pp > 1:
            raise ParallelismError("parallelism.cp > 1 with parallelism.pp > 1 is not supported yet")
        others = dp_replicate * tp * pp * cp
        if dp_shard == -1:
            if world_size % others:
                raise ParallelismError(
                    f"world size {world_size} is not divisible by dp_replicate*cp*tp*pp = {others}")
            dp_shard = world_size // others
        if dp_shard < 1 or dp_shard * others != world_size:
            raise ParallelismError(
                f"dp_replicate({dp_replicate}) * dp_shard({dp_shard}) * cp({cp}) * tp({tp}) * pp({pp}) = "
                f"{dp_shard * others}, but the world size is {world_size}")
        return cls(dp_replicate, dp_shard, tp, pp, world_size, cp)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those holding different samples (the loader's and the batch's degree)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks the gradients are averaged over (the data-parallel ones and, in each, its CP ranks)."""
        return self.dp * self.cp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp_shard`` (with CP: ``dp_shard × cp`` flattened to
    ``dp_shard_cp``), under ``dp_replicate`` for HSDP."""
    if dims.cp == 1:
        return mesh["dp_shard"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    # HSDP: a 2-D mesh over a flattened dimension is still sliced from the root (torch warns that
    # this goes away; torchtitan does the same today)
    return flat if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard_cp"]


def dp_rank(mesh: DeviceMesh, dims: ParallelDims) -> int:
    """This rank's index among the data-parallel ranks (what the data loader shards by)."""
    return mesh.get_local_rank("dp_replicate") * dims.dp_shard + mesh.get_local_rank("dp_shard")


TP_TOP: dict[str, int] = {"tok_embeddings": 0, "output": 0}
"""Tensor parallelism outside the blocks: module -> the dimension of its weight that is split
(both by vocabulary); the final norm is replicated (sequence parallel)."""
TP_BLOCK: dict[str, int] = {
    "attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
    "feed_forward.w1": 0, "feed_forward.w2": 1, "feed_forward.w3": 0,
}
"""Tensor parallelism inside a block: module (relative to the block) -> the dimension of its weight
that is split: 0 by output features (ColwiseParallel), 1 by input features (RowwiseParallel); the
norms are replicated (sequence parallel). :func:`apply_tp` applies these two tables and the dry-run
plan (:mod:`trainer.plan`) counts what they leave on one rank."""


def tp_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits parameter ``name`` (a state-dict key) along (None:
    replicated)."""
    for module, dim in (*TP_BLOCK.items(), *TP_TOP.items()):
        if name.endswith(f"{module}.weight"):
            return dim
    return None


def check_tp_heads(args, tp: int) -> None:
    """ParallelismError unless ``tp`` divides the query and the key/value heads of ``args``."""
    for what, count in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads)):
        if count % tp:
            raise ParallelismError(f"{what} = {count} is not divisible by parallelism.tp = {tp}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool = True) -> None:
    """Megatron-style tensor parallelism with sequence parallelism (torchtitan's plan, the tables
    :data:`TP_TOP` and :data:`TP_BLOCK`): q/k/v and w1/w3 split by output features, wo and w2 by
    input features, so each block needs one all-gather in and one reduce-scatter out; norms and
    the residual stream are sharded along the sequence between blocks; the embedding is split by
    vocabulary. The output projection's logits stay split by vocabulary (DTensors, ``Shard(-1)``)
    for the loss (:mod:`trainer.loss`, loss parallel), or with ``loss_parallel`` off are gathered
    whole on every rank (plain tensors)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tp_heads(model.args, tp_mesh.size())
    top = {}
    if model.tok_embeddings is not None:  # an Embedding's rows (TP_TOP: dim 0) are "rowwise" in DTensor's words
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
                         if loss_parallel else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():  # fresh styles per block, as parallelize_module is given them
        block_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
        for name, dim in TP_BLOCK.items():
            block_plan[name] = ColwiseParallel() if dim == 0 else RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(block, tp_mesh, block_plan)


SAVED_ATEN_OPS = (
    "mm", "addmm", "bmm",
    # every SDPA kernel: flash, memory-efficient, cuDNN, CPU flash, the one a PrivateUse1 device
    # registers, and the memory-efficient forward that the CP causal bias calls directly (fp32 on CUDA)
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_efficient_attention_forward",
)
"""The ``torch.ops.aten`` ops whose outputs op-level activation checkpointing keeps (those this torch
has; the rest are recomputed)."""
SAVED_NPU_OPS = ("npu_fusion_attention", "npu_fusion_attention_v2", "npu_fusion_attention_v3")
"""torch_npu's fused attention ops (``torch.ops.npu``; torch_npu runs SDPA on the NPU as
``npu_fusion_attention_v3``), kept too when torch_npu is loaded."""


def op_level_saved_ops() -> frozenset:
    """The op overloads op-level activation checkpointing saves: :data:`SAVED_ATEN_OPS`, and
    :data:`SAVED_NPU_OPS` where torch_npu has been imported — its ops cannot run otherwise, and it is
    never imported here (the device resolution imports it on an NPU machine, before the model is
    wrapped)."""
    import sys

    found = [(torch.ops.aten, name) for name in SAVED_ATEN_OPS]
    if "torch_npu" in sys.modules:
        found += [(torch.ops.npu, name) for name in SAVED_NPU_OPS]
    return frozenset(getattr(space, name).default for space, name in found if hasattr(space, name))


def apply_activation_checkpointing(model: nn.Module, *, every: int = 1, op_level: bool = False) -> None:
    """Recompute activations in backward instead of keeping them: every ``every``-th block (by its
    global layer index, so a pipeline stage picks the same blocks as the whole model), either whole
    (full recomputation) or, with ``op_level``, keeping the matmul and attention outputs
    (:func:`op_level_saved_ops`) and recomputing only the cheap element-wise ops between them
    (selective op-level checkpointing)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = op_level_saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    for name, block in list(model.layers.items()):
        if int(name) % every:
            continue
        if op_level:
            model.layers[name] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False,
                context_fn=partial(create_selective_checkpoint_contexts, policy))
        else:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_compile(model: nn.Module) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)


COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool, precision: str = "fp32",
               cpu_offload: bool = False, ignored_params: set | None = None) -> nn.Module:
    """FSDP2 over ``mesh`` per block, then the root (HSDP when ``mesh`` is 2-D); ``ignored_params``
    (expert-parallel experts, :mod:`trainer.expert_parallel`) are left as they are."""
    low = COMPUTE_DTYPES[precision]
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low is not None else None)
    extra = {"ignored_params": ignored_params} if ignored_params else {}
    if cpu_offload:  # parameters, gradients and optimizer state in host memory (the seeds' swap optimizer)
        from torch.distributed.fsdp import CPUOffloadPolicy

        # pinned host memory speeds the copies to an accelerator; without one there is none to pin
        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy, **extra)
    # The root keeps embeddings/norm/output; its parameters are needed again right after forward.
    return fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy, **extra)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    from torch._subclasses.fake_tensor import FakeTensor

    group = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp").get_group()
    device_ids = None if device.type == "cpu" else [device.index]
    # A measured dry run (fake tensors, fake process group) has no values to compare across ranks:
    # DDP's initial shape check reads one with .item(). Ranks built the same model from the same seed.
    fake = any(isinstance(p, FakeTensor) or p.is_meta for p in model.parameters())
    return DistributedDataParallel(model, process_group=group, device_ids=device_ids, init_sync=not fake)


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, *, zero_stage: int, precision: str,
                activation_checkpointing: bool, compile: bool, device: torch.device, ac_every: int = 1,
                ac_op_level: bool = False, cpu_offload: bool = False, loss_parallel: bool = True,
                ignored_params: set | None = None) -> nn.Module:
    if cpu_offload and (dims.dp_cp == 1 or zero_stage == 0):
        raise ParallelismError("optimization.cpu_offload needs FSDP2: zero_stage >= 1 and more than one "
                               "data-parallel rank")
    if dims.tp > 1:
        if zero_stage == 0 and dims.dp_cp > 1:
            raise ParallelismError("zero_stage 0 (DDP) cannot wrap a tensor-parallel model; use zero_stage >= 1")
        apply_tp(model, mesh["tp"], loss_parallel=loss_parallel)
    if dims.cp > 1:
        apply_cp(model, mesh["cp"])
    if activation_checkpointing:
        apply_activation_checkpointing(model, every=ac_every, op_level=ac_op_level)
    if compile:
        apply_compile(model)
    if dims.dp_cp == 1:
        return model
    if zero_stage == 0:
        if dims.dp_replicate > 1:
            raise ParallelismError("zero_stage 0 (DDP) replicates over all dp ranks; set dp_replicate = 1")
        return apply_ddp(model, mesh, device)
    return apply_fsdp(model, fsdp_mesh(mesh, dims), reshard_after_forward=zero_stage == 3, precision=precision,
                      cpu_offload=cpu_offload, ignored_params=ignored_params)


def uses_autocast(model: nn.Module) -> bool:
    """bf16/fp16 through autocast (DDP, unwrapped) rather than FSDP2's mixed-precision policy."""
    return not isinstance(model, FSDPModule)


def accumulates_unsharded(zero_stage: int, option: bool | None) -> bool:
    """Whether FSDP2 keeps whole (unsharded) gradients between micro-steps (``optimization.accumulate_unsharded``;
    none: only for zero_stage 1, which shards the optimizer state but not the gradients, as ZeRO-1
    does); otherwise every micro-step (and pipeline microbatch) reduce-scatters its gradients into
    the sharded ones (FSDP2's default), so only a 1/dp_shard share is held during accumulation."""
    return zero_stage == 1 if option is None else bool(option)


def set_gradient_sync(model: nn.Module, enabled: bool):
    """Context for one micro-step: with ``enabled`` off, DDP skips its all-reduce and FSDP2 its
    reduce-scatter (accumulating whole gradients until a micro-step with it on)."""
    import contextlib

    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync") and not enabled:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def all_reduce_mean(value: torch.Tensor, group=None) -> float | list[float]:
    """The mean over the ranks of a scalar (a float) or of a vector (a list, one collective)."""
    value = value.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.AVG if value.device.type != "cpu" else dist.ReduceOp.SUM,
                        group=group)
        if value.device.type == "cpu":
            value /= dist.get_world_size(group)
    return value.tolist()

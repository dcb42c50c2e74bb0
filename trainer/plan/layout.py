"""The parallel layout a dry run plans for, checked with the trainer's own rules.

Contract: :func:`resolve_layout` resolves the degrees with :meth:`trainer.parallel.ParallelDims.resolve`
(``dp_replicate × dp_shard × cp × tp × pp = world size``, ``dp_shard = -1`` fills) and refuses, with
:class:`~trainer.parallel.ParallelismError`, what the trainer would refuse when it builds the model:
heads not divisible by tp (:func:`trainer.parallel.check_tp_heads`), fewer layers than pipeline
stages, DDP (``zero_stage = 0``) with tp, ``dp_replicate > 1`` or pp, ``cpu_offload`` without FSDP2,
an expert-parallel degree that does not fit (:func:`trainer.expert_parallel.check`).
:class:`Layout` says how the model is wrapped and over how many ranks a piece of state is sharded
or replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config
from ..expert_parallel import check as check_ep
from ..model import ModelArgs
from ..parallel import ParallelDims, ParallelismError, check_tp_heads


@dataclass(frozen=True)
class Layout(ParallelDims):
    """The trainer's :class:`~trainer.parallel.ParallelDims` and how the model is wrapped."""

    wrap: str = "none"  # "fsdp", "ddp" or "none"
    ep: int = 1  # expert parallel: the routed experts split over ep ranks (borrowed from dp_shard)

    @property
    def shard(self) -> int:
        """Ranks each parameter (and its optimizer state) is sharded over (FSDP2: dp_shard × cp)."""
        return self.dp_shard * self.cp if self.wrap == "fsdp" else 1

    @property
    def replicas(self) -> int:
        """Ranks holding the same piece of state (DCP writes it once)."""
        return self.dp_cp // self.shard


def resolve_layout(cfg: Config, world_size: int, args: ModelArgs) -> Layout:
    """The layout for ``world_size`` ranks (see the module docstring for what is refused)."""
    p = cfg.parallelism
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ParallelismError(f"the world size must be a positive integer, not {world_size!r}")
    cp = int(getattr(p, "cp", 1) or 1)
    dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.tp, p.pp, world_size, cp)
    check_tp_heads(args, p.tp)
    stages = p.pp * virtual_stages(cfg)
    if args.n_layers < stages:
        raise ParallelismError(f"model.n_layers = {args.n_layers} cannot fill {stages} pipeline stages")
    dp = dims.dp_cp  # the ranks a wrapper spans: the data-parallel ones and their CP ranks
    zero = cfg.optimization.zero_stage
    if dp > 1 and zero == 0 and p.tp > 1:
        raise ParallelismError("zero_stage 0 (DDP) cannot wrap a tensor-parallel model; use zero_stage >= 1")
    if dp > 1 and zero == 0 and p.dp_replicate > 1:
        raise ParallelismError("zero_stage 0 (DDP) replicates over all dp ranks; set dp_replicate = 1")
    if dp > 1 and zero == 0 and p.pp > 1:
        raise ParallelismError("zero_stage 0 (DDP) cannot wrap pipeline stages; use zero_stage >= 1")
    wrap = "none" if dp == 1 else ("ddp" if zero == 0 else "fsdp")
    if getattr(cfg.optimization, "cpu_offload", False) and wrap != "fsdp":
        raise ParallelismError("optimization.cpu_offload needs FSDP2: zero_stage >= 1 and more than one "
                               "data-parallel rank")
    ep = int(getattr(p, "ep", 1) or 1)
    check_ep(ep, num_experts=args.num_experts, dp_shard=dims.dp_shard, tp=p.tp, pp=p.pp, zero_stage=zero, cp=cp)
    return Layout(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, world_size, cp, wrap, ep)


def virtual_stages(cfg: Config) -> int:
    return int(getattr(cfg.parallelism, "pp_virtual_stages", 1) or 1)


def schedule(cfg: Config) -> str:
    return str(getattr(cfg.parallelism, "pp_schedule", "1f1b") or "1f1b").lower()

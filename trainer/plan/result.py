"""What a dry run finds: :class:`Plan` (one per configuration and world size) and its :class:`StagePlan` s.

Contract: plain data. :data:`ITEMS` names every memory figure of a stage in display order (the keys
of :attr:`StagePlan.memory`); :meth:`Plan.to_dict` is what ``--json`` prints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ITEMS: dict[str, str] = {
    "params": "parameters (master weights)",
    "optimizer": "AdamW exp_avg + exp_avg_sq",
    "ddp_buckets": "DDP gradient buckets (fp32)",
    "buffers": "buffers (RoPE cos/sin tables, fp32)",
    "grads": "gradients of earlier micro-steps (held)",
    "grad_accumulation": "unsharded fp32 gradients (no-sync accumulation)",
    "head_grads": "norm + output gradients (first in backward)",
    "compute_params": "compute copies of parameters",
    "reduce_scatter": "reduce-scatter working set (one FSDP unit)",
    "activations": "saved activations (all in-flight microbatches)",
    "recompute": "recomputed layer (activation checkpointing)",
    "loss": "final norm + logits + loss (last stage)",
    "stage_outputs": "stage outputs kept for backward (pipeline)",
    "step_grads": "gradients at the optimizer step",
    "optimizer_step": "optimizer step temporaries",
}
"""Every memory figure of a stage, in display order, with its label."""


@dataclass
class StagePlan:
    """One pipeline rank (every rank of a stage is alike: TP and data-parallel peers hold as much;
    with uneven FSDP shards the figures are the fullest rank's)."""

    stage: int
    layers: list[int]  # global layer indices this rank holds
    holds: list[str]  # "embedding", "norm + output"
    params_local: int  # after TP and PP, before data-parallel sharding
    params: int  # what this rank stores (after FSDP sharding)
    in_flight: int  # microbatches whose activations it holds at once
    memory: dict[str, int]  # bytes, keys of ITEMS
    peak: int  # bytes
    peak_other_checkpointing: int  # the peak with optimization.gradient_checkpointing flipped
    checkpoint_write: int  # bytes this rank writes for a full checkpoint
    staging_host: int  # host bytes for double-buffered staging
    host_offload: int = 0  # host bytes of parameters, gradients and AdamW state under cpu_offload
    phases: dict[str, int] = field(default_factory=dict)  # bytes at backward start / end / optimizer step


@dataclass
class Plan:
    """Everything the dry run found; :func:`trainer.plan.format_plan` prints it, :meth:`to_dict` is the JSON."""

    source: str | None
    model: dict[str, Any]
    layout: dict[str, Any]
    batch: dict[str, Any]
    stages: list[StagePlan]
    roles: list[dict[str, Any]]
    device: dict[str, Any]
    verdict: dict[str, Any]
    checkpoint: dict[str, Any]
    formulas: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        """The fullest rank's peak, bytes."""
        return max(s.peak for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["peak_bytes"] = self.peak
        out["memory_labels"] = dict(ITEMS)
        return out

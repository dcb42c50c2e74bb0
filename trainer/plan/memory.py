"""What one rank holds (bytes; P = parameters this rank stores, P_l = its parameters after TP and PP
but before data-parallel sharding, e = 2 for bf16/fp16 compute, 4 for fp32):

* parameters 4·P (fp32 masters, also with precision bf16/fp16), gradients 4·P, AdamW exp_avg and
  exp_avg_sq 8·P. FSDP2 (zero_stage >= 1, dp > 1) shards every parameter's dim 0 over dp_shard
  (ceil: the fullest rank); DDP (zero_stage 0) and one data-parallel rank hold P = P_l. With
  optimization.cpu_offload (where the configuration has it) FSDP2 keeps these 16·P bytes and the
  optimizer step on the host; otherwise they are on the device. DDP adds gradient buckets 4·P_l.
* compute copies. FSDP2 all-gathers parameters in the compute dtype: zero_stage 1/2 keep every
  layer's unsharded copy from its forward to its backward (e·P_l at the start of backward); zero_stage
  3 holds the root's (embedding, norm, output: never resharded after forward) plus two layers (the
  current and the prefetched one). Under a pipeline, torch.distributed.pipelining keeps parameters
  unsharded between microbatches (reshard_after_backward off), so e·P_l whatever the stage. Without
  FSDP2, bf16/fp16 run under autocast, whose cache holds a copy of every Linear weight: 2·(Linear P_l).
* gradient accumulation. FSDP2 with gradient sync off (every micro-step but the last, and every
  pipeline microbatch but the last) keeps each parameter's unsharded gradient in fp32: 4·P_l. The
  reduce-scatter itself needs (e + 4)·(largest FSDP unit) for one unit at a time.
* activations per microbatch of b sequences of s tokens (h dim, f SwiGLU width, a heads, V vocab;
  under TP + sequence parallelism s_t = ceil(s/tp), and heads, kv heads, f split by tp). Counted
  from what autograd saves in this model's block (fused SDPA attention: q, k, v, output and the
  log-sum-exp, no s×s scores; RMSNorm upcasts its input to fp32), checked against the saved tensors
  of a real block in tests/trainer/plan/test_build.py:

      per layer = b·s_t·(8h + 2·e_n·h + 8) + b·s·n_in·e·h + b·s·(4·e·h + 4·a + 4·e·f)/tp

  norm inputs in fp32 and the normalised values (e_n) along the sequence; n_in gathered inputs of
  the projections (q/k/v and w1/w3 share one: n_in = 2; autocast casts it for each: n_in = 5, e_n =
  4); q, k, v, attention output, log-sum-exp and w1, silu, w3, product (k and v are repeated to
  every head by a copy, except where a rank holds one kv head: then 2·e·h becomes 2·e·head_dim
  for k and v). bf16 (FSDP2 mixed precision):
  24h + 8f + 8 + 4a bytes per token and layer at tp = 1; fp32: 40h + 16f + 8 + 4a; autocast:
  34h + 8f + 8 + 4a. For comparison Korthikanti et al. (2022) give s·b·h·(34 + 5·a·s/h) for a GPT
  block in half precision storing the attention scores; this model's SwiGLU (f ~ 2.7h) and fp32 norm
  inputs cost more per token, and the fused attention stores no scores.
  With activation checkpointing (full recomputation of every block) a layer keeps only its input,
  b·s_t·e_in·h (e_in = 2 in bf16 FSDP2, else 4: the residual stream is fp32), and backward
  recomputes one layer at a time (its full figure once). optimization.ac_every = n checkpoints the
  layers whose global index is a multiple of n (the others keep everything); optimization.ac_op_level
  keeps, besides the input, every matmul's and attention's output: b·s·(e·(2·a·hd + 2·kv·hd + 2f)/tp
  + 4a/tp + 2·e·h) (wo's and w2's outputs are whole-sequence partial sums before their
  reduce-scatter). The first stage also keeps the token ids
  (8·b·s); the last keeps the final norm, the output's gathered input and the loss: logits, their
  log-softmax and its gradient, b·s·(e + 8)·V (the output projection gathers whole logits: not /tp).
* pipeline: layers cut into consecutive runs per stage (the first stages take one more when pp does
  not divide n_layers), the embedding on stage 0, norm and output on the last. With 1F1B stage r
  holds the activations of min(pp - r, microbatches) microbatches (GPipe: all of them).
* tensor parallelism (torchtitan's plan, trainer.parallel.apply_tp): wq/wk/wv and w1/w3 split by
  output features, wo and w2 by input features, embedding and output by vocabulary, norms replicated.
* optimizer step: foreach AdamW makes one fp32 temporary of 4·P while the activations are gone.

  peak = parameters + gradients + optimizer (+ DDP buckets)
         + max(compute copies + accumulation + reduce-scatter + activations + loss, optimizer step)

Not counted: the runtime (CUDA/CANN context, NCCL/HCCL buffers, allocator fragmentation: a few
GiB), pipeline send/receive buffers, backward's transient gradient buffers, torch.compile workspaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..model import ModelArgs
from .activations import (
    Numerics,
    head_activation_bytes,
    layer_activation_bytes,
    layer_input_bytes,
    layer_op_level_bytes,
)
from .checkpoint import rank_checkpoint
from .layout import Layout
from .result import ITEMS, StagePlan

PERSISTENT = ("params", "grads", "optimizer", "ddp_buckets")
STEP = ("optimizer_step",)


@dataclass(frozen=True)
class Microbatch:
    """What one microbatch of ``b`` sequences of ``s`` tokens saves: a layer in full, a layer under
    activation checkpointing (``kept_layer``), the last stage's head, the first stage's token ids."""

    b: int
    s: int
    count: int  # microbatches per step through the pipeline (1 without one)
    layer: int
    kept_layer: int
    head: int
    ids: int


def microbatch(args: ModelArgs, num: Numerics, tp: int, batch: dict[str, Any], *, op_level: bool) -> Microbatch:
    """The :class:`Microbatch` of the plan's ``batch`` section."""
    b, s = batch.get("pipeline_microbatch_size", batch["micro_batch_size"]), batch["seq_len"]
    kept = (layer_op_level_bytes if op_level else layer_input_bytes)(args, num, tp, b, s)
    return Microbatch(b, s, batch.get("pipeline_microbatches", 1), layer_activation_bytes(args, num, tp, b, s),
                      kept, head_activation_bytes(args, num, tp, b, s), 8 * b * s)


def peak_bytes(memory: dict[str, int]) -> int:
    """A rank's peak: what persists, plus the larger of backward's transients and the optimizer step's."""
    persistent = sum(memory[k] for k in PERSISTENT)
    transient = sum(v for k, v in memory.items() if k not in PERSISTENT and k not in STEP)
    return persistent + max(transient, sum(memory[k] for k in STEP))


def _in_flight(schedule: str, pp: int, stage: int, microbatches: int) -> int:
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    return min(pp - stage, microbatches)  # 1F1B (interleaved: estimated like 1F1B)


def stage_plans(cfg: Config, lay: Layout, num: Numerics, mb: Microbatch, batch: dict[str, Any],
                per: list[dict[str, int]], layer_local: int, ranges: list[range], schedule: str) -> list[StagePlan]:
    """One :class:`StagePlan` per pipeline rank, from its parameters (``per``:
    :func:`trainer.plan.params.rank_params`) and the microbatch's activations."""
    o, c = cfg.optimization, cfg.checkpoint
    checkpointing = bool(o.gradient_checkpointing)
    # Options of newer builds of the configuration (absent: what this trainer did before them).
    ac_every = max(1, int(getattr(o, "ac_every", 1) or 1))
    offload = bool(getattr(o, "cpu_offload", False))
    accumulations = mb.count if lay.pp > 1 else batch["gradient_accumulation_steps"]
    stages = []
    for rank in range(lay.pp):
        d = per[rank]
        layers = [i for k, r in enumerate(ranges) if k % lay.pp == rank for i in r]
        first, last = rank == 0, rank == lay.pp - 1
        in_flight = _in_flight(schedule, lay.pp, rank, mb.count)
        P, P_l = d["stored"], d["local"]
        mem = dict.fromkeys(ITEMS, 0)
        mem["params"], mem["grads"], mem["optimizer"] = 4 * P, 4 * P, 8 * P
        mem["optimizer_step"] = 4 * P
        host = 0
        if offload:  # FSDP2 CPUOffloadPolicy: sharded state and the optimizer step live on the host
            host = sum(mem[k] for k in ("params", "grads", "optimizer"))
            for k in ("params", "grads", "optimizer", "optimizer_step"):
                mem[k] = 0
        if lay.wrap == "ddp":
            mem["ddp_buckets"] = 4 * P_l
        if lay.wrap == "fsdp":
            if o.zero_stage in (1, 2) or lay.pp > 1:
                mem["compute_params"] = num.e_param * P_l
            else:
                mem["compute_params"] = num.e_param * (d["root"] + min(2, len(layers)) * layer_local)
            if accumulations > 1:
                mem["grad_accumulation"] = 4 * P_l
            mem["reduce_scatter"] = (num.e_param + 4) * max(layer_local if layers else 0, d["root"])
        elif o.precision != "fp32":
            mem["compute_params"] = 2 * d["linear"]

        def activations(ckpt_on: bool, every: int) -> tuple[int, int]:
            kept = sum(1 for i in layers if i % every == 0) if ckpt_on else 0  # by global index
            per_mb = kept * mb.kept_layer + (len(layers) - kept) * mb.layer + (mb.ids if first else 0)
            return in_flight * per_mb, (mb.layer if kept else 0)

        mem["activations"], mem["recompute"] = activations(checkpointing, ac_every)
        mem["loss"] = mb.head if last else 0

        other = dict(mem)
        other["activations"], other["recompute"] = activations(not checkpointing, 1)
        write, staging = rank_checkpoint(P, d["tensors"], first=first, replicas=lay.replicas,
                                         async_mode=c.async_mode)
        holds = (["embedding"] if first else []) + (["norm + output"] if last else [])
        stages.append(StagePlan(
            stage=rank, layers=layers, holds=holds, params_local=P_l, params=P, in_flight=in_flight,
            memory=mem, peak=peak_bytes(mem), peak_other_checkpointing=peak_bytes(other),
            checkpoint_write=write, staging_host=staging, host_offload=host))
    return stages


def roles(stages: list[StagePlan]) -> list[dict[str, Any]]:
    """The report's columns: every rank alike, or the first, the fullest middle and the last stage."""
    pp = len(stages)
    if pp == 1:
        return [{"name": "every rank", "stage": 0}]
    out = [{"name": "first stage (0)", "stage": 0}]
    if pp > 2:
        worst = max(stages[1:-1], key=lambda st: st.peak).stage
        out.append({"name": f"middle 1-{pp - 2} (fullest: {worst})", "stage": worst})
    out.append({"name": f"last stage ({pp - 1})", "stage": pp - 1})
    return out

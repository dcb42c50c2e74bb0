"""What one rank holds (bytes; P = parameters this rank stores, P_l = its parameters after TP and PP
but before data-parallel sharding, e = 2 for bf16/fp16 compute, 4 for fp32):

* parameters e_m·P (master weights: fp32, e_m = 4, also with precision bf16/fp16; or bf16, e_m = 2,
  with optimization.master_dtype = bf16), AdamW exp_avg and exp_avg_sq 2·e_s·P (e_s = 4, or 2 with
  optimization.optimizer_state_dtype = bf16). FSDP2 (zero_stage >= 1, dp > 1) shards every
  parameter's dim 0 over dp_shard (ceil: the fullest rank); DDP (zero_stage 0) and one
  data-parallel rank hold P = P_l. With optimization.cpu_offload FSDP2 keeps parameters,
  gradients and optimizer state and the optimizer step on the host. DDP adds gradient buckets 4·P_l.
* gradients, in the parameters' dtype (e_m), counted where they are held and never twice: at the
  optimizer step e_m·P; during backward, what earlier micro-steps (or pipeline microbatches) left:
  FSDP2 reduce-scatters every micro-step into the sharded gradients (zero_stage 2/3, the default:
  e_m·P), or with optimization.accumulate_unsharded (default for zero_stage 1) keeps each
  parameter's whole gradient in fp32 until the last micro-step (4·P_l, and no sharded gradient
  beside it); without FSDP2 the accumulated e_m·P_l. The root's norm and output gradients appear
  first in backward and stay until FSDP2 reduces the root at its end: e·(norm + output P_l).
* compute copies. FSDP2 all-gathers parameters in the compute dtype: zero_stage 1/2 keep every
  layer's unsharded copy from its forward to its backward (e·P_l at the start of backward); zero_stage
  3 holds the root's (embedding, norm, output: never resharded after forward) plus two layers (the
  current and the prefetched one). Under a pipeline, torch.distributed.pipelining keeps parameters
  unsharded between microbatches (reshard_after_backward off), so e·P_l whatever the stage. Without
  FSDP2, bf16/fp16 run under autocast, whose cache holds a copy of every Linear weight: 2·(Linear P_l).
  The reduce-scatter needs (e + 4)·(largest FSDP unit) for one unit at a time.
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
  for k and v). With activation checkpointing (full recomputation of every block) a layer keeps
  only its input, b·s_t·e_in·h (e_in = 2 in bf16 FSDP2, else 4), and backward recomputes one layer
  at a time (its full figure once). optimization.ac_every = n checkpoints the layers whose global
  index is a multiple of n; optimization.ac_op_level keeps, besides the input, every matmul's and
  attention's output: b·s·(e·(2·a·hd + 2·kv·hd + 2f)/tp + 4a/tp + 2·e·h). The first stage also
  keeps the token ids (8·b·s); the last keeps the final norm, the output's gathered input and the
  loss: logits, their log-softmax and its gradient, b·c·(e + 8)·V_l, where V_l = ceil(V/tp) under
  loss parallel (TP with optimization.loss_parallel) and V otherwise, and c the positions of one
  chunk of the chunked loss (optimization.loss_chunk_len; the whole sequence s when off or longer).
* context parallelism (parallelism.cp, trainer.context_parallel): every sequence split over cp
  ranks, so s above is seq_len / cp for every per-position figure; attention adds what
  :func:`~trainer.plan.activations.cp_gathered_bytes` counts, the whole sequence's gathered keys
  and values b·(S - s)·2·e·hd·kv' more than the local ones (kv' as above) and the causal masks of the
  rank's two chunks, e·(2cp + 1)·L² with L = S / (2cp). FSDP2 shards over dp_shard·cp.
* pipeline: layers cut into consecutive runs per stage (the first stages take one more when pp does
  not divide n_layers), the embedding on stage 0, norm and output on the last. With 1F1B stage r
  holds the activations of min(pp - r, microbatches) microbatches (GPipe: all of them), and every
  stage but the last the outputs it sent for them, b·s_t·e_in·h each, until their backward.
* buffers: RoPE's cos and sin tables on every rank, fp32, 4·max_seq_len·head_dim.
* tensor parallelism (torchtitan's plan, trainer.parallel.apply_tp): wq/wk/wv and w1/w3 split by
  output features, wo and w2 by input features, embedding and output by vocabulary, norms replicated.
* optimizer step: foreach AdamW makes one fp32 temporary of 4·P while the activations are gone;
  trainer.optim's per-tensor AdamW (bf16 masters or moments) a few fp32 copies of its largest
  tensor (LEAN_STEP_BYTES per element).

  peak = parameters + optimizer (+ DDP buckets) + buffers + the largest of three moments (:func:`phases`):
         backward start (held gradients + norm/output gradients + compute copies + unsharded
         accumulation + reduce-scatter + activations + recomputed layer + loss + stage outputs), backward end (this
         step's gradients + the same but the activations down to one layer's and no loss), and the
         optimizer step (the gradients + its temporaries)

Checked against one real step measured at the full world size (trainer.measure, --dry-run
--measure): within 10 % in tests/trainer/test_measure.py. Not counted: the runtime (CUDA/CANN
context, NCCL/HCCL buffers, allocator caching and fragmentation: a few GiB), pipeline
receive buffers, backward's transient gradients of activations, torch.compile workspaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..model import ModelArgs
from .activations import (
    Numerics,
    cp_gathered_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    layer_input_bytes,
    layer_op_level_bytes,
)
from .checkpoint import rank_checkpoint, state_bytes_per_param
from .layout import Layout
from ..parallel import accumulates_unsharded
from .result import ITEMS, StagePlan

LEAN_STEP_BYTES = {(4, 2): 24, (2, 4): 24, (2, 2): 32}
"""Bytes per element of the largest local tensor that trainer.optim.LeanAdamW's per-tensor step
holds at once, by (master, moment) bytes: fp32 copies of the moments it upcasts, of the gradient
and parameter it upcasts, sqrt and denominator, and the two int32 buffers of stochastic rounding."""
PERSISTENT = ("params", "optimizer", "ddp_buckets", "buffers")
STEP = ("step_grads", "optimizer_step")


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
    output: int = 0  # one stage output (the hidden states sent to the next stage)
    buffers: int = 0  # the model's buffers: RoPE's cos and sin tables, fp32


def microbatch(args: ModelArgs, num: Numerics, tp: int, batch: dict[str, Any], *, op_level: bool,
               loss_parallel: bool = False, chunk_len: int = 0, cp: int = 1) -> Microbatch:
    """The :class:`Microbatch` of the plan's ``batch`` section; under context parallelism ``cp`` a
    rank holds ``seq_len / cp`` positions of each sequence (and the gathered keys/values)."""
    b, whole = batch.get("pipeline_microbatch_size", batch["micro_batch_size"]), batch["seq_len"]
    s = whole // cp
    kept = (layer_op_level_bytes if op_level else layer_input_bytes)(args, num, tp, b, s)
    head = head_activation_bytes(args, num, tp, b, s, loss_parallel=loss_parallel, chunk_len=chunk_len)
    layer = layer_activation_bytes(args, num, tp, b, s) + cp_gathered_bytes(args, num, tp, b, whole, cp)
    return Microbatch(b, s, batch.get("pipeline_microbatches", 1), layer,
                      kept, head, 8 * b * s, output=b * -(-s // tp) * args.dim * num.e_input,
                      buffers=4 * args.max_seq_len * args.head_dim)


def phases(memory: dict[str, int], end_activations: int = 0) -> dict[str, int]:
    """A rank's memory at the three moments one of which is its peak (all with what persists:
    parameters, optimizer state, DDP buckets):

    * backward start: every saved activation and the loss, the gradients held from earlier
      micro-steps, the norm/output gradients, compute copies, one reduce-scatter, a recomputed layer;
    * backward end (the first layer's backward): this step's gradients all there (sharded, or the
      unsharded no-sync buffer), the activations down to ``end_activations`` (one layer's), the rest
      as at the start but the loss;
    * optimizer step: the gradients and the step's temporaries.
    """
    persistent = sum(memory[k] for k in PERSISTENT)
    start = sum(v for k, v in memory.items() if k not in PERSISTENT and k not in STEP)
    grads = memory["grad_accumulation"] or memory["step_grads"]
    end = grads + sum(memory[k] for k in ("head_grads", "compute_params", "reduce_scatter", "recompute")) + end_activations
    return {"backward start": persistent + start, "backward end": persistent + end,
            "optimizer step": persistent + sum(memory[k] for k in STEP)}


def peak_bytes(memory: dict[str, int], end_activations: int = 0) -> int:
    """A rank's peak: the fullest of its :func:`phases`."""
    return max(phases(memory, end_activations).values())


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
    unsharded = accumulates_unsharded(o.zero_stage, getattr(o, "accumulate_unsharded", None))
    e_master = 2 if getattr(o, "master_dtype", "fp32") == "bf16" else 4
    e_moment = 2 if getattr(o, "optimizer_state_dtype", "fp32") == "bf16" else 4
    lean = e_master == 2 or e_moment == 2  # trainer.optim.LeanAdamW: one tensor at a time
    lean_step = LEAN_STEP_BYTES[(e_master, e_moment)] if lean else 0
    stages = []
    for rank in range(lay.pp):
        d = per[rank]
        layers = [i for k, r in enumerate(ranges) if k % lay.pp == rank for i in r]
        first, last = rank == 0, rank == lay.pp - 1
        in_flight = _in_flight(schedule, lay.pp, rank, mb.count)
        P, P_l = d["stored"], d["local"]
        mem = dict.fromkeys(ITEMS, 0)
        fsdp = lay.wrap == "fsdp"
        mem["params"], mem["optimizer"] = e_master * P, 2 * e_moment * P
        mem["step_grads"] = e_master * P  # FSDP2's sharded gradients are in the parameters' dtype
        mem["optimizer_step"] = lean_step * d["largest"] if lean else 4 * P
        if fsdp and unsharded and accumulations > 1:
            mem["grad_accumulation"] = 4 * P_l  # and no sharded gradient until the last reduce-scatter
        elif accumulations > 1:
            mem["grads"] = e_master * P  # sharded (FSDP2) or whole (DDP, unwrapped) from earlier micro-steps
        if last and (fsdp or accumulations == 1):  # FSDP2 reduces the root's gradients at the end of backward
            mem["head_grads"] = (num.e_param if fsdp else e_master) * d["head"]
        host = 0
        if offload:  # FSDP2 CPUOffloadPolicy: sharded state and the optimizer step live on the host
            host = mem["params"] + mem["optimizer"] + mem["step_grads"]
            for k in ("params", "grads", "optimizer", "step_grads", "optimizer_step"):
                mem[k] = 0
        if lay.wrap == "ddp":
            mem["ddp_buckets"] = 4 * P_l
        if fsdp:
            if o.zero_stage in (1, 2) or lay.pp > 1:
                mem["compute_params"] = num.e_param * P_l
            else:
                mem["compute_params"] = num.e_param * (d["root"] + min(2, len(layers)) * layer_local)
            mem["reduce_scatter"] = (num.e_param + 4) * max(layer_local if layers else 0, d["root"])
        elif o.precision != "fp32" and e_master == 4:
            mem["compute_params"] = 2 * d["linear"]

        def activations(ckpt_on: bool, every: int) -> tuple[int, int, int]:
            """(saved, recomputed, what the stage's first layer saves: all that is left at the end)."""
            kept = sum(1 for i in layers if i % every == 0) if ckpt_on else 0  # by global index
            per_mb = kept * mb.kept_layer + (len(layers) - kept) * mb.layer + (mb.ids if first else 0)
            last_left = (mb.kept_layer if ckpt_on and layers and layers[0] % every == 0 else mb.layer if layers else 0)
            return in_flight * per_mb, (mb.layer if kept else 0), last_left + (mb.ids if first else 0)

        mem["activations"], mem["recompute"], end = activations(checkpointing, ac_every)
        mem["loss"] = mb.head if last else 0
        mem["buffers"] = mb.buffers
        # The schedule keeps each in-flight microbatch's output until its backward (not saved by
        # autograd: a block's last op, the residual add, saves nothing).
        mem["stage_outputs"] = in_flight * mb.output if lay.pp > 1 and not last else 0

        other = dict(mem)
        other["activations"], other["recompute"], other_end = activations(not checkpointing, 1)
        write, staging = rank_checkpoint(P, d["tensors"], first=first, replicas=lay.replicas,
                                         async_mode=c.async_mode, per_param=state_bytes_per_param(cfg))
        holds = (["embedding"] if first else []) + (["norm + output"] if last else [])
        stages.append(StagePlan(
            stage=rank, layers=layers, holds=holds, params_local=P_l, params=P, in_flight=in_flight,
            memory=mem, peak=peak_bytes(mem, end), peak_other_checkpointing=peak_bytes(other, other_end),
            phases=phases(mem, end),
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

"""The dry-run plan: memory per rank and the checkpoint a configuration needs, before anything runs.

    python -m trainer.plan --config FILE [--world-size N] [--device-memory GIB|NAME]
                           [--storage-gbps X] [--storage-shared] [--json] [--section.key value ...]

No process group, no device, no tensor: the model is built on the meta device (shapes only, instant
for 70B) and every figure is arithmetic on its parameters' shapes, the layout and the batch.

Flags (everything else is the trainer's configuration, read by :func:`trainer.config.load_config`):

  --world-size N         ranks to plan for; default: $WORLD_SIZE, else the product of the degrees
                         when dp_shard is given, else 1 (a plain ``python -m trainer.train``)
  --device-memory G|NAME memory of one device in GiB, or a device of :data:`KNOWN_DEVICES` (e.g.
                         H100); default: the Ascend 910B for training.device = npu, otherwise the
                         verdict is given for every known device
  --storage-gbps X       GB/s (10^9 bytes) one rank can write to the checkpoint storage (default 2)
  --storage-shared       the ranks share one link of that speed (time = whole checkpoint / X);
                         default: each rank has its own (time = the largest rank's share / X)
  --json                 the plan as JSON (:meth:`Plan.to_dict`)

Exit codes (:mod:`trainer.exits`): 0 with the plan on stdout (also when it does not fit: that is a
finding, not an error); 2 and one ``error: ...`` line on stderr for a configuration or layout that
cannot work (degrees vs the world size, heads not divisible by tp, fewer layers than stages, DDP
with dp_replicate > 1, tp or pp, cpu_offload without FSDP2, an unreadable file, a bad flag). What
the trainer would refuse later but does not stop the arithmetic (a batch that does not add up,
gradient accumulation with a pipeline) is listed under problems in the plan.

What one rank holds (bytes; P = parameters this rank stores, P_l = its parameters after TP and PP
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
  of a real block in tests/trainer/test_plan.py:

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

The checkpoint: fp32 parameters + AdamW states (12 bytes per parameter) + small state (AdamW step
counters, 4 bytes per tensor; scheduler, data loader and counters, a few KiB). DCP writes every
tensor once: a piece held by several ranks (data-parallel replicas, DDP) is written by one of them,
so the total is the unique state and each rank writes its local state / the replicas of it. Deltas
(checkpoint.full_every > 1) and zstd fulls are sized with the ratios measured in
benchmarks/RESULTS.md ("Incremental checkpoints"). See docs/DRY_RUN.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer import exits
from trainer import model as model_mod
from trainer.config import Config, ConfigError, load_config
from trainer.data import is_byte_tokenizer, load_tokenizer
from trainer.model import BYTE_VOCAB_SIZE, FLAVORS, ModelArgs, ffn_hidden_dim
from trainer.parallel import ParallelismError
from trainer.pipeline import layer_ranges

GIB = 2**30

KNOWN_DEVICES: dict[str, float] = {
    "Ascend 910B": 64.0,  # 64 GB HBM: 65536 MB as npu-smi reports it
    "A100": 80.0,  # A100 80GB: 81920 MiB (nvidia-smi)
    "H100": 81559 / 1024,  # H100 SXM 80GB: 81559 MiB = 79.6 GiB
    "H200": 143771 / 1024,  # H200 141GB: 143771 MiB = 140.4 GiB
}
"""Total memory of one device in GiB, as the runtime reports it (vendors' nominal sizes: 910B 64 GB,
A100 80 GB, H100 80 GB, H200 141 GB)."""

DEVICE_TYPES = {"npu": "Ascend 910B"}
"""training.device values that name one known device (cuda could be any of the others)."""

LLAMA2_PARAMS = {"7b": 6_738_415_616, "13b": 13_015_864_320, "70b": 68_976_648_192}
"""Parameters of Meta's Llama-2 checkpoints (vocabulary 32000), to check the flavors against."""

RESULTS = "benchmarks/RESULTS.md, \"Incremental checkpoints\""
DELTA_RATIO = {10: 0.780, 50: 0.814, 100: 0.818}
"""Stored delta / raw bytes for fp32 weights + AdamW states, by save interval: the measured median
of the `small` flavor (25M parameters, the larger one measured; `debug` gives 0.761/0.798/0.804)."""
DELTA_RATIO_BF16 = {10: 0.476, 50: 0.564, 100: 0.578}
"""The same for bf16 weights alone; not what this trainer stores (its masters are fp32): cited only."""
ZSTD_FULL_RATIO = 0.832
"""A full checkpoint with checkpoint.compress = zstd (byte planes), fp32 + AdamW, `small` flavor."""
ENCODE_GBPS_PER_CORE = 0.35
"""The delta encoder, one thread (raw GB/s; the median of the latest full run — the repeats spanned
0.35-0.53 and an earlier run measured 0.60: the shared box's CPU speed varies)."""
SMALL_STATE_BYTES = 4096
"""Scheduler, data loader position, train counters, optimizer param groups: an estimate."""

ITEMS: dict[str, str] = {
    "params": "fp32 parameters (masters)",
    "grads": "fp32 gradients",
    "optimizer": "AdamW exp_avg + exp_avg_sq (fp32)",
    "ddp_buckets": "DDP gradient buckets (fp32)",
    "compute_params": "compute copies of parameters",
    "grad_accumulation": "unsharded fp32 gradients (no-sync accumulation)",
    "reduce_scatter": "reduce-scatter working set (one FSDP unit)",
    "activations": "saved activations (all in-flight microbatches)",
    "recompute": "recomputed layer (activation checkpointing)",
    "loss": "final norm + logits + loss (last stage)",
    "optimizer_step": "optimizer step temporaries (foreach AdamW)",
}
"""Every memory figure of a stage, in display order, with its label."""
PERSISTENT = ("params", "grads", "optimizer", "ddp_buckets")
STEP = ("optimizer_step",)


# ---------------------------------------------------------------------------------------------------
# The plan


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


@dataclass
class Plan:
    """Everything the dry run found; :func:`format_plan` prints it, :meth:`to_dict` is the JSON."""

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


# ---------------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class _Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    wrap: str  # "fsdp", "ddp" or "none"

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks each parameter (and its optimizer state) is sharded over."""
        return self.dp_shard if self.wrap == "fsdp" else 1

    @property
    def replicas(self) -> int:
        """Ranks holding the same piece of state (DCP writes it once)."""
        return self.dp // self.shard


def resolve_layout(cfg: Config, world_size: int, args: ModelArgs) -> _Layout:
    """The layout for ``world_size`` ranks, checked with the trainer's rules (dp_replicate × dp_shard
    × tp × pp = world size, dp_shard -1 filling) without relying on ParallelDims accepting tp/pp."""
    p = cfg.parallelism
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ParallelismError(f"the world size must be a positive integer, not {world_size!r}")
    for name in ("dp_replicate", "tp", "pp"):
        if getattr(p, name) < 1:
            raise ParallelismError(f"parallelism.{name} must be >= 1, got {getattr(p, name)}")
    others = p.dp_replicate * p.tp * p.pp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ParallelismError(f"world size {world_size} is not divisible by dp_replicate*tp*pp = {others}")
        dp_shard = world_size // others
    if dp_shard < 1 or others * dp_shard != world_size:
        raise ParallelismError(
            f"dp_replicate({p.dp_replicate}) * dp_shard({dp_shard}) * tp({p.tp}) * pp({p.pp}) = "
            f"{others * dp_shard}, but the world size is {world_size}")
    for what, count in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads)):
        if count % p.tp:
            raise ParallelismError(f"{what} = {count} is not divisible by parallelism.tp = {p.tp}")
    stages = p.pp * _virtual_stages(cfg)
    if args.n_layers < stages:
        raise ParallelismError(f"model.n_layers = {args.n_layers} cannot fill {stages} pipeline stages")
    dp = p.dp_replicate * dp_shard
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
    return _Layout(p.dp_replicate, dp_shard, p.tp, p.pp, world_size, wrap)


def _virtual_stages(cfg: Config) -> int:
    return int(getattr(cfg.parallelism, "pp_virtual_stages", 1) or 1)


def _schedule(cfg: Config) -> str:
    return str(getattr(cfg.parallelism, "pp_schedule", "1f1b") or "1f1b").lower()


# ---------------------------------------------------------------------------------------------------
# Parameters


def meta_model(args: ModelArgs) -> model_mod.Transformer:
    """The model on the meta device: shapes, no storage."""
    with torch.device("meta"):
        return model_mod.Transformer(args)


_COLUMN = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
           "feed_forward.w1.weight", "feed_forward.w3.weight", "tok_embeddings.weight", "output.weight")
_ROW = ("attention.wo.weight", "feed_forward.w2.weight")


def tp_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits parameter ``name`` along (None: replicated)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def tp_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape one TP rank holds (the fullest one when the split is uneven)."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return tuple(shape)
    out = list(shape)
    out[dim] = -(-out[dim] // tp)
    return tuple(out)


def shard_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of the fullest FSDP2 shard of a tensor of ``shape`` (dim 0 split in ``shards``)."""
    if not shape:
        return 1
    return -(-shape[0] // shards) * math.prod(shape[1:])


def _owner_stage(name: str, ranges: list[range]) -> int:
    if name.startswith("layers."):
        layer = int(name.split(".")[1])
        return next(i for i, r in enumerate(ranges) if layer in r)
    return 0 if name.startswith("tok_embeddings.") else len(ranges) - 1


def _breakdown(model: torch.nn.Module) -> dict[str, int]:
    counts = {"embedding": 0, "attention": 0, "feed_forward": 0, "norms": 0, "output": 0}
    for name, p in model.named_parameters():
        if name.startswith("tok_embeddings."):
            counts["embedding"] += p.numel()
        elif name.startswith("output."):
            counts["output"] += p.numel()
        elif ".attention." in name:
            counts["attention"] += p.numel()
        elif ".feed_forward." in name:
            counts["feed_forward"] += p.numel()
        else:
            counts["norms"] += p.numel()
    return counts


# ---------------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True)
class Numerics:
    """Bytes per element of what the block saves (see the module docstring)."""

    name: str
    e: int  # projections' outputs, attention, SwiGLU
    e_norm: int  # normalised values saved by the norm's weight multiply
    e_input: int  # a block's input (what activation checkpointing keeps)
    gathered_inputs: int  # copies of the projections' inputs saved
    e_param: int  # compute copies of parameters


def numerics(precision: str, wrap: str) -> Numerics:
    """What saves what in ``precision`` (fp32, or bf16/fp16: mixed) under ``wrap`` (fsdp, ddp, none)."""
    if precision == "fp32":
        return Numerics("fp32", 4, 4, 4, 2, 4)
    if wrap == "fsdp":
        return Numerics(f"{precision} (FSDP2 mixed precision)", 2, 2, 2, 2, 2)
    return Numerics(f"{precision} (autocast)", 2, 4, 4, 5, 2)


def layer_activation_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int) -> int:
    """Bytes one layer saves for backward for one microbatch of ``b`` sequences of ``s`` tokens."""
    h, a, f = args.dim, args.n_heads // tp, -(-ffn_hidden_dim(args) // tp)
    s_t = -(-s // tp)
    # k and v reach attention repeated to every query head (a copy), unless a rank has one kv head:
    # then the repeat is a stride-0 view of it.
    kv = 1 if args.kv_heads // tp == 1 else a
    along_sequence = b * s_t * (8 * h + 2 * num.e_norm * h + 8)
    gathered = b * s * num.gathered_inputs * num.e * h
    split = b * s * (num.e * args.head_dim * (2 * a + 2 * kv) + 4 * a + 4 * num.e * f)
    return along_sequence + gathered + split


def layer_input_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int) -> int:
    """What a layer keeps under activation checkpointing: its input."""
    return b * -(-s // tp) * num.e_input * args.dim


def layer_op_level_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int) -> int:
    """What a layer keeps under selective op-level checkpointing (optimization.ac_op_level): its
    input plus the outputs of its matmuls and of attention (q, k, v, wo, w1, w3, w2; output and
    log-sum-exp); wo's and w2's local outputs are whole-sequence partial sums before their
    reduce-scatter, so not divided by tp."""
    a, kv, f = args.n_heads // tp, args.kv_heads // tp, -(-ffn_hidden_dim(args) // tp)
    hd = args.head_dim
    outputs = num.e * (2 * a * hd + 2 * kv * hd + 2 * f + 2 * args.dim) + 4 * a
    return layer_input_bytes(args, num, tp, b, s) + b * s * outputs


def head_activation_bytes(args: ModelArgs, num: Numerics, tp: int, b: int, s: int) -> int:
    """The last stage's final norm, the output's gathered input and the loss (logits, log-softmax,
    its gradient), for one microbatch."""
    h = args.dim
    norm = b * -(-s // tp) * (4 * h + num.e_norm * h + 4)
    output_input = b * s * num.e * h
    loss = b * s * (num.e + 8) * args.vocab_size
    return norm + output_input + loss


def korthikanti_layer_bytes(args: ModelArgs, tp: int, b: int, s: int) -> int:
    """Korthikanti et al. (2022), half precision, full attention storage, sequence parallel."""
    return int(s * b * args.dim * (34 + 5 * args.n_heads * s / args.dim) / tp)


# ---------------------------------------------------------------------------------------------------
# Building the plan


def model_args_for(cfg: Config) -> ModelArgs:
    """The model's shapes as the trainer derives them (the tokenizer's vocabulary unless given)."""
    vocab = None
    if cfg.model.vocab_size is None:
        if is_byte_tokenizer(cfg.model.tokenizer):
            vocab = BYTE_VOCAB_SIZE
        else:
            try:
                vocab = load_tokenizer(cfg.model.tokenizer).vocab_size
            except (OSError, ImportError, ValueError) as exc:
                raise ConfigError(f"model.tokenizer={cfg.model.tokenizer!r} cannot be read: {exc}") from None
    return cfg.model_args(vocab)


def _batch(cfg: Config, dp: int, pp: int, problems: list[str]) -> dict[str, Any]:
    t = cfg.training
    try:
        micro, accumulation = cfg.resolve_batch(dp)
    except ConfigError as exc:
        problems.append(f"{exc} (the trainer refuses this with exit 2; planned with micro_batch_size="
                        f"{t.micro_batch_size or max(1, t.batch_size // dp)})")
        micro = t.micro_batch_size or max(1, t.batch_size // dp)
        accumulation = t.gradient_accumulation_steps or 1
    out = {"global_batch": t.batch_size, "micro_batch_size": micro, "gradient_accumulation_steps": accumulation,
           "dp": dp, "seq_len": t.seq_len, "tokens_per_microbatch": micro * t.seq_len}
    if pp > 1:
        # A step's per-rank batch (micro x accumulation sequences) goes through the pipeline schedule
        # at once, in parallelism.pp_microbatches microbatches (none: the accumulation steps, or pp
        # without accumulation) — as trainer.train does.
        per_rank = micro * accumulation
        n = getattr(cfg.parallelism, "pp_microbatches", None) or (accumulation if accumulation > 1 else pp)
        if per_rank % n:
            problems.append(f"the per-rank batch of a step ({per_rank} sequences) is not divisible by {n} "
                            "pipeline microbatches")
        size = max(1, per_rank // n)
        out.update(pipeline_microbatches=n, pipeline_microbatch_size=size, tokens_per_microbatch=size * t.seq_len)
    return out


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


def plan(cfg: Config, world_size: int, *, device_memory_gib: float | None = None, device: str | None = None,
         storage_gbps: float = 2.0, storage_shared: bool = False, source: str | None = None) -> Plan:
    """The dry-run plan of ``cfg`` on ``world_size`` ranks (see the module docstring for every
    formula). ``device_memory_gib`` or ``device`` (a :data:`KNOWN_DEVICES` name) sets the memory to
    judge against; otherwise training.device = npu means the Ascend 910B and any other device is
    judged against every known device. Raises ConfigError / ParallelismError for a configuration or
    layout that cannot work."""
    if not storage_gbps > 0:
        raise ConfigError(f"the storage speed must be > 0 GB/s, got {storage_gbps}")
    args = model_args_for(cfg)
    lay = resolve_layout(cfg, world_size, args)
    o, c = cfg.optimization, cfg.checkpoint
    problems: list[str] = []
    notes: list[str] = []
    num = numerics(o.precision, lay.wrap)
    checkpointing = bool(o.gradient_checkpointing)
    # Options of newer builds of the configuration (absent: what this trainer did before them).
    ac_every = max(1, int(getattr(o, "ac_every", 1) or 1))
    op_level = bool(getattr(o, "ac_op_level", False))
    offload = bool(getattr(o, "cpu_offload", False))
    batch = _batch(cfg, lay.dp, lay.pp, problems)
    schedule, virtual = _schedule(cfg), _virtual_stages(cfg)

    model = meta_model(args)
    assert all(p.is_meta for p in model.parameters())
    total = model_mod.num_params(model)
    n_stages = lay.pp * virtual
    ranges = layer_ranges(args.n_layers, n_stages)

    # Per pipeline rank: P_l (after TP/PP), P (after FSDP), Linear P_l, root P_l, tensors.
    per = [dict(local=0, stored=0, linear=0, root=0, tensors=0) for _ in range(lay.pp)]
    layer_local = 0
    for name, p in model.named_parameters():
        rank = _owner_stage(name, ranges) % lay.pp
        shape = tp_shape(name, tuple(p.shape), lay.tp)
        local = math.prod(shape)
        d = per[rank]
        d["local"] += local
        d["stored"] += shard_numel(shape, lay.shard)
        d["tensors"] += 1
        if p.dim() == 2 and not name.startswith("tok_embeddings."):
            d["linear"] += local
        if not name.startswith("layers."):
            d["root"] += local
        elif name.startswith("layers.0."):
            layer_local += local

    b, s = batch.get("pipeline_microbatch_size", batch["micro_batch_size"]), batch["seq_len"]
    microbatches = batch.get("pipeline_microbatches", 1)
    accumulations = microbatches if lay.pp > 1 else batch["gradient_accumulation_steps"]
    full_layer = layer_activation_bytes(args, num, lay.tp, b, s)
    kept_layer = (layer_op_level_bytes if op_level else layer_input_bytes)(args, num, lay.tp, b, s)
    head = head_activation_bytes(args, num, lay.tp, b, s)
    ids = 8 * b * s

    stages = []
    for rank in range(lay.pp):
        d = per[rank]
        layers = [i for k, r in enumerate(ranges) if k % lay.pp == rank for i in r]
        first, last = rank == 0, rank == lay.pp - 1
        in_flight = _in_flight(schedule, lay.pp, rank, microbatches)
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
            per_mb = kept * kept_layer + (len(layers) - kept) * full_layer + (ids if first else 0)
            return in_flight * per_mb, (full_layer if kept else 0)

        mem["activations"], mem["recompute"] = activations(checkpointing, ac_every)
        mem["loss"] = head if last else 0

        other = dict(mem)
        other["activations"], other["recompute"] = activations(not checkpointing, 1)
        local_state = 12 * P + 4 * d["tensors"] + (SMALL_STATE_BYTES if first else 0)
        holds = (["embedding"] if first else []) + (["norm + output"] if last else [])
        stages.append(StagePlan(
            stage=rank, layers=layers, holds=holds, params_local=P_l, params=P, in_flight=in_flight,
            memory=mem, peak=peak_bytes(mem), peak_other_checkpointing=peak_bytes(other),
            checkpoint_write=-(-local_state // lay.replicas),
            staging_host=2 * local_state if c.async_mode == "double_buffer" else 0, host_offload=host))

    if lay.pp == 1:
        roles = [{"name": "every rank", "stage": 0}]
    else:
        roles = [{"name": "first stage (0)", "stage": 0}]
        if lay.pp > 2:
            worst = max(stages[1:-1], key=lambda st: st.peak).stage
            roles.append({"name": f"middle 1-{lay.pp - 2} (fullest: {worst})", "stage": worst})
        roles.append({"name": f"last stage ({lay.pp - 1})", "stage": lay.pp - 1})

    model_info = _model_info(cfg, args, model, total, notes)
    dev = _device(cfg, device_memory_gib, device)
    verdict = _verdict(stages, dev)
    ckpt_info = _checkpoint(cfg, total, len(list(model.parameters())), stages, lay, storage_gbps, storage_shared)

    layout = _layout_info(cfg, lay, num, schedule, virtual, ranges)
    if lay.pp > 1 and schedule == "interleaved1f1b":
        notes.append("interleaved 1F1B: in-flight microbatches estimated as for 1F1B")
    if o.compile:
        notes.append("optimization.compile: compiled blocks may save less than eager (not modelled)")

    formulas = [
        f"activations per layer and microbatch ({b} x {s} tokens, {num.name}, tp {lay.tp}): "
        f"b*ceil(s/tp)*(8h + 2*{num.e_norm}h + 8) + b*s*{num.gathered_inputs}*{num.e}h + "
        f"b*s*(4*{num.e}h + 4a + 4*{num.e}f)/tp = {_mib(full_layer)} "
        f"(Korthikanti et al. s*b*h*(34 + 5as/h)/tp, GPT block storing attention scores: "
        f"{_mib(korthikanti_layer_bytes(args, lay.tp, b, s))})",
        (f"with op-level activation checkpointing a layer keeps its input b*ceil(s/tp)*{num.e_input}h and its "
         f"matmul/attention outputs b*s*({num.e}*(2h + 2kv*hd + 2f)/tp + 4a/tp + 2*{num.e}h) = {_mib(kept_layer)}"
         if op_level else
         f"with activation checkpointing a layer keeps its input b*ceil(s/tp)*{num.e_input}h = {_mib(kept_layer)}")
        + f", plus one layer recomputed ({_mib(full_layer)})"
        + (f"; only layers with index % {ac_every} == 0 are checkpointed" if ac_every > 1 else ""),
        f"last stage: final norm + gathered output input + logits/log-softmax/gradient "
        f"b*s*({num.e}+8)*V = {_mib(head)}",
        "peak = params + grads + optimizer (+ DDP buckets) + max(compute copies + accumulation + "
        "reduce-scatter + activations + loss, optimizer step)",
    ]
    return Plan(source=source, model=model_info, layout=layout, batch=batch, stages=stages, roles=roles,
                device=dev, verdict=verdict, checkpoint=ckpt_info, formulas=formulas, notes=notes,
                problems=problems)


def _layout_info(cfg: Config, lay: _Layout, num: Numerics, schedule: str, virtual: int,
                 ranges: list[range]) -> dict[str, Any]:
    o = cfg.optimization
    if lay.wrap == "fsdp":
        hsdp = f", HSDP x{lay.dp_replicate} replicas" if lay.dp_replicate > 1 else ""
        reshard = "reshard after forward" if o.zero_stage == 3 else "no reshard after forward"
        data_parallel = f"FSDP2 over dp_shard {lay.dp_shard}{hsdp}, zero_stage {o.zero_stage} ({reshard})"
    elif lay.wrap == "ddp":
        data_parallel = f"DDP over {lay.dp} ranks (zero_stage 0)"
    else:
        data_parallel = "none (one data-parallel rank: the model is not wrapped)"
    return {
        "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp, "pp": lay.pp,
        "world_size": lay.world_size, "data_parallel": data_parallel,
        "wrap": lay.wrap, "zero_stage": o.zero_stage, "precision": o.precision, "numerics": num.name,
        "activation_checkpointing": bool(o.gradient_checkpointing),
        "ac_every": int(getattr(o, "ac_every", 1) or 1), "ac_op_level": bool(getattr(o, "ac_op_level", False)),
        "cpu_offload": bool(getattr(o, "cpu_offload", False)), "offload_option": hasattr(o, "cpu_offload"),
        "pipeline_schedule": schedule if lay.pp > 1 else None, "pp_virtual_stages": virtual,
        "layers_per_stage": [len(r) for r in ranges],
    }


def _model_info(cfg: Config, args: ModelArgs, model: torch.nn.Module, total: int, notes: list[str]) -> dict[str, Any]:
    flavor = cfg.model.flavor.lower()
    info = {
        "name": cfg.model.name, "flavor": cfg.model.flavor, "args": dataclasses.asdict(args),
        "ffn_hidden_dim": ffn_hidden_dim(args), "head_dim": args.head_dim, "params": total,
        "params_by_module": _breakdown(model), "param_tensors": len(list(model.parameters())),
        "built_on": "meta",
    }
    reference = LLAMA2_PARAMS.get(flavor)
    if reference is not None:
        info["llama2_reference"] = reference
        if total != reference:
            why = []
            base = FLAVORS[flavor]
            for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads"):
                if getattr(args, key) != getattr(base, key):
                    why.append(f"{key} {getattr(args, key)} instead of {getattr(base, key)}")
            notes.append(f"{total:,} parameters, not Llama-2 {flavor.upper()}'s {reference:,} "
                         f"({total - reference:+,}): " + (", ".join(why) or "shapes differ"))
    return info


def _device(cfg: Config, memory_gib: float | None, name: str | None) -> dict[str, Any]:
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ConfigError(f"--device-memory must be > 0 GiB, got {memory_gib}")
        return {"name": name, "memory_gib": float(memory_gib), "source": "--device-memory"}
    if name is not None:
        key = known_device(name)
        if key is None:
            raise ConfigError(f"--device-memory {name!r} is neither a number of GiB nor a known device "
                              f"({', '.join(KNOWN_DEVICES)})")
        return {"name": key, "memory_gib": KNOWN_DEVICES[key], "source": "--device-memory"}
    key = DEVICE_TYPES.get(cfg.training.device)
    if key is not None:
        return {"name": key, "memory_gib": KNOWN_DEVICES[key], "source": f"training.device = {cfg.training.device}"}
    return {"name": None, "memory_gib": None,
            "source": f"training.device = {cfg.training.device}: not one known device"}


def known_device(name: str) -> str | None:
    """The :data:`KNOWN_DEVICES` key ``name`` names (case, spaces and dashes ignored; the longest
    key contained in it wins: "NVIDIA H100 80GB HBM3" → "H100", "910b" → "Ascend 910B")."""
    def norm(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    if name.strip().lower() in DEVICE_TYPES:
        return DEVICE_TYPES[name.strip().lower()]
    wanted = norm(name)
    hits = [k for k in KNOWN_DEVICES if norm(k) in wanted or (len(wanted) >= 4 and wanted in norm(k))]
    return max(hits, key=len) if hits else None


def _judge(peak: int, memory_gib: float) -> dict[str, Any]:
    spare = memory_gib - peak / GIB
    if spare < 0:
        return {"fits": False, "text": f"does not fit by {-spare:.1f} GiB", "spare_gib": round(spare, 2)}
    tight = spare < max(2.0, 0.05 * memory_gib)
    text = f"fits, {spare:.1f} GiB to spare" + (" (tight: the runtime itself needs a few GiB)" if tight else "")
    return {"fits": True, "text": text, "spare_gib": round(spare, 2)}


def _verdict(stages: list[StagePlan], dev: dict[str, Any]) -> dict[str, Any]:
    worst = max(stages, key=lambda st: st.peak)
    out: dict[str, Any] = {"peak_gib": round(worst.peak / GIB, 2), "fullest_stage": worst.stage}
    if dev["memory_gib"] is not None:
        out.update(_judge(worst.peak, dev["memory_gib"]))
    else:
        out["fits"] = None
        out["text"] = "device memory unknown (--device-memory GIB|NAME)"
        out["by_device"] = {k: _judge(worst.peak, v)["text"] for k, v in KNOWN_DEVICES.items()}
    return out


def _interval_ratio(interval: int) -> tuple[float, int, bool]:
    """(ratio, measured interval it comes from, extrapolated?)."""
    for measured in sorted(DELTA_RATIO):
        if interval <= measured:
            return DELTA_RATIO[measured], measured, False
    return DELTA_RATIO[100], 100, True


def _checkpoint(cfg: Config, total: int, tensors: int, stages: list[StagePlan], lay: _Layout,
                gbps: float, shared: bool) -> dict[str, Any]:
    c = cfg.checkpoint
    tensor_bytes = 12 * total
    unique = tensor_bytes + 4 * tensors + SMALL_STATE_BYTES
    full_ratio = ZSTD_FULL_RATIO if c.compress == "zstd" else 1.0
    full_total = int(tensor_bytes * full_ratio) + unique - tensor_bytes
    per_rank_max = max(st.checkpoint_write for st in stages)
    ratio, measured, extrapolated = _interval_ratio(c.interval)
    delta_total = int(tensor_bytes * ratio) + unique - tensor_bytes
    rate = gbps * 1e9
    out: dict[str, Any] = {
        "enabled": c.enable, "unique_bytes": unique, "full_bytes": full_total,
        "full_ratio": full_ratio, "writers": lay.world_size, "replicas_per_piece": lay.replicas,
        "per_rank_bytes": {str(st.stage): st.checkpoint_write for st in stages},
        "per_rank_max_bytes": per_rank_max,
        "storage_gbps": gbps, "storage_shared": shared,
        "seconds_parallel": per_rank_max * full_ratio / rate,
        "seconds_shared": full_total / rate,
        "full_every": c.full_every, "interval": c.interval, "compress": c.compress,
        "delta_ratio": ratio, "delta_ratio_interval": measured, "delta_ratio_extrapolated": extrapolated,
        "delta_bytes": delta_total,
        "delta_seconds_parallel": per_rank_max * ratio / rate, "delta_seconds_shared": delta_total / rate,
        "delta_encode_cpu_seconds_per_rank": per_rank_max / (ENCODE_GBPS_PER_CORE * 1e9),
        "delta_ratio_bf16_weights_cited": DELTA_RATIO_BF16,
        "source": RESULTS,
        "staging_host_bytes_per_rank": max(st.staging_host for st in stages),
    }
    if c.full_every > 1:
        out["mean_bytes_per_save"] = (full_total + (c.full_every - 1) * delta_total) // c.full_every
    out["seconds"] = out["seconds_shared"] if shared else out["seconds_parallel"]
    out["delta_seconds"] = out["delta_seconds_shared"] if shared else out["delta_seconds_parallel"]
    return out


# ---------------------------------------------------------------------------------------------------
# Output


def _in(unit: int):
    return lambda n: f"{n / unit:.2f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _size(n: int | float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _seconds(t: float) -> str:
    if t < 0.1:
        return f"{t * 1000:.1f} ms"
    return f"{t:.1f} s" if t < 120 else f"{t / 60:.1f} min"


def _layers(layers: list[int]) -> str:
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ",".join(map(str, layers))


def format_plan(p: Plan) -> str:
    """The plan as a readable report: model, layout, one column per rank role, verdict, checkpoint."""
    m, lay, bt, ck = p.model, p.layout, p.batch, p.checkpoint
    a = m["args"]
    lines = [f"Dry run{' of ' + p.source if p.source else ''}: {m['name']} {m['flavor']} on "
             f"{lay['world_size']} ranks (nothing started; the model is built on the meta device)", ""]
    ref = m.get("llama2_reference")
    check = "" if ref is None else (f" = Llama-2 {m['flavor'].upper()}'s {ref:,}" if ref == m["params"]
                                    else f", Llama-2 {m['flavor'].upper()} has {ref:,}")
    lines.append(f"Model      {m['params']:,} parameters{check}")
    kv = a["n_kv_heads"] or a["n_heads"]
    lines.append(f"           dim {a['dim']}, {a['n_layers']} layers, {a['n_heads']} heads ({kv} kv, head dim "
                 f"{m['head_dim']}), SwiGLU {m['ffn_hidden_dim']}, vocab {a['vocab_size']}")
    by = m["params_by_module"]
    lines.append("           " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in by.items()))
    lines.append(f"Layout     dp_replicate {lay['dp_replicate']} x dp_shard {lay['dp_shard']} x tp {lay['tp']} x "
                 f"pp {lay['pp']} = {lay['world_size']}; data parallel: {lay['data_parallel']}")
    ac = "off"
    if lay["activation_checkpointing"]:
        ac = "on (" + ("op-level: matmul and attention outputs kept" if lay["ac_op_level"] else
                       "full recomputation per block")
        ac += f", one block in {lay['ac_every']})" if lay["ac_every"] > 1 else ")"
    where = ("parameters, gradients and optimizer state offloaded to the host (optimization.cpu_offload)"
             if lay["cpu_offload"] else "optimizer state on the device"
             + ("" if lay["offload_option"] else " (no offload option)"))
    lines.append(f"           {lay['numerics']}; activation checkpointing {ac}; {where}")
    lines.append(f"Batch      global {bt['global_batch']} = micro {bt['micro_batch_size']} x accumulation "
                 f"{bt['gradient_accumulation_steps']} x dp {bt['dp']}"
                 + ("" if bt["micro_batch_size"] * bt["gradient_accumulation_steps"] * bt["dp"] == bt["global_batch"]
                    else f" = {bt['micro_batch_size'] * bt['gradient_accumulation_steps'] * bt['dp']} (!)")
                 + f"; seq_len {bt['seq_len']}")
    if lay["pp"] > 1:
        per_stage = lay["layers_per_stage"]
        lines.append(f"Pipeline   {lay['pipeline_schedule']}, {bt['pipeline_microbatches']} microbatches of "
                     f"{bt['pipeline_microbatch_size']}; layers per stage {'/'.join(map(str, per_stage))}; "
                     "embedding on stage 0, norm + output on the last; in flight "
                     + "/".join(str(st.in_flight) for st in p.stages))
    lines.append("")

    cols = [(r["name"], p.stages[r["stage"]]) for r in p.roles]
    width = max(44, *(len(label) + 2 for label in ITEMS.values()))
    colw = max(14, *(len(name) + 2 for name, _ in cols))
    row = lambda label, values: f"{label:<{width}}" + "".join(f"{v:>{colw}}" for v in values)  # noqa: E731
    unit, scale = ("GiB", GIB) if p.peak >= GIB else ("MiB", 2**20)
    _gib = _in(scale)
    lines.append(row(f"Per rank ({unit})", [name for name, _ in cols]))
    lines.append(row("layers", [_layers(st.layers) for _, st in cols]))
    lines.append(row("parameters after TP/PP", [f"{st.params_local:,}" for _, st in cols]))
    lines.append(row("parameters stored (after FSDP)", [f"{st.params:,}" for _, st in cols]))
    if lay["pp"] > 1:
        lines.append(row("microbatches in flight", [str(st.in_flight) for _, st in cols]))
    for key, label in ITEMS.items():
        values = [st.memory[key] for _, st in cols]
        if any(values):
            lines.append(row("  " + label, [_gib(v) for v in values]))
    lines.append(row("peak", [_gib(st.peak) for _, st in cols]))
    if any(st.host_offload for _, st in cols):
        lines.append(row("host: offloaded params + grads + AdamW", [_gib(st.host_offload) for _, st in cols]))
    flip = "off" if lay["activation_checkpointing"] else "on"
    lines.append(row(f"peak with activation checkpointing {flip}",
                     [_gib(st.peak_other_checkpointing) for _, st in cols]))
    lines.append("")

    v, dev = p.verdict, p.device
    if dev["memory_gib"] is not None:
        lines.append(f"Verdict    {dev['name'] or 'device'} {dev['memory_gib']:.1f} GiB ({dev['source']}): "
                     f"{v['text']} (fullest rank: stage {v['fullest_stage']}, {v['peak_gib']:.2f} GiB)")
    else:
        lines.append(f"Verdict    {dev['source']}; the fullest rank (stage {v['fullest_stage']}) needs "
                     f"{v['peak_gib']:.2f} GiB:")
        for name, text in v["by_device"].items():
            lines.append(f"           {name} {KNOWN_DEVICES[name]:.1f} GiB: {text}")
    lines.append("")

    off = "" if ck["enabled"] else " (checkpoint.enable = false: nothing is written; if it were)"
    lines.append(f"Checkpoint{off}")
    lines.append(f"           unique state {_size(ck['unique_bytes'])} (fp32 params + AdamW, 12 B/param, + small "
                 f"state); DCP writes each piece once over {ck['writers']} ranks "
                 f"({ck['replicas_per_piece']} holder{'s' if ck['replicas_per_piece'] > 1 else ''} per piece)")
    full = f"full {_size(ck['full_bytes'])}" + (f" (zstd x{ck['full_ratio']})" if ck["compress"] == "zstd" else "")
    link = (f"one shared {ck['storage_gbps']:g} GB/s link" if ck["storage_shared"]
            else f"{ck['storage_gbps']:g} GB/s per rank in parallel")
    lines.append(f"           {full}; per rank up to {_size(ck['per_rank_max_bytes'] * ck['full_ratio'])}; "
                 f"{_seconds(ck['seconds'])} at {link}"
                 + ("" if ck["storage_shared"] else f" ({_seconds(ck['seconds_shared'])} through one shared link)"))
    extra = " (extrapolated: measured up to 100)" if ck["delta_ratio_extrapolated"] else ""
    lines.append(f"           delta ~{_size(ck['delta_bytes'])} (x{ck['delta_ratio']} raw: fp32 + AdamW, interval "
                 f"{ck['delta_ratio_interval']} in {ck['source']}{extra}); {_seconds(ck['delta_seconds'])} to write; "
                 f"encoding {_seconds(ck['delta_encode_cpu_seconds_per_rank'])} of one core per rank at "
                 f"{ENCODE_GBPS_PER_CORE} GB/s")
    if ck["full_every"] > 1:
        lines.append(f"           full_every {ck['full_every']}: {_size(ck['mean_bytes_per_save'])} "
                     "per save on average")
    else:
        lines.append("           checkpoint.full_every = 1: every save is full (deltas need full_every > 1)")
    if ck["staging_host_bytes_per_rank"]:
        lines.append(f"           host memory for double-buffered staging: {_size(ck['staging_host_bytes_per_rank'])} "
                     "per rank (2 x its local state)")
    lines.append("")
    lines.append("Formulas")
    lines.extend(f"           {f}" for f in p.formulas)
    for title, items in (("Notes", p.notes), ("PROBLEMS", p.problems)):
        if items:
            lines.append(title)
            lines.extend(f"           {i}" for i in items)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Command line


_FLAGS = {"--world-size": int, "--device-memory": str, "--storage-gbps": float, "--storage-shared": bool,
          "--json": bool}


def split_flags(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(this module's flags, the rest for :func:`trainer.config.load_config`)."""
    own: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        name, eq, value = arg.partition("=")
        kind = _FLAGS.get(name)
        if kind is None:
            rest.append(arg)
            continue
        if kind is bool:
            if eq:
                raise ConfigError(f"{name} takes no value")
            own[name] = True
            continue
        if not eq:
            if i >= len(argv):
                raise ConfigError(f"{name} needs a value")
            value, i = argv[i], i + 1
        try:
            own[name] = kind(value)
        except ValueError:
            raise ConfigError(f"{name} expects {'an integer' if kind is int else 'a number'}, got {value!r}") from None
    return own, rest


def _default_world(cfg: Config, notes: list[str]) -> int:
    env = os.environ.get("WORLD_SIZE")
    if env and env.isdigit():
        notes.append(f"world size {env} from $WORLD_SIZE")
        return int(env)
    p = cfg.parallelism
    if p.dp_shard != -1:
        return p.dp_replicate * p.dp_shard * p.tp * p.pp
    others = p.dp_replicate * p.tp * p.pp
    notes.append(f"world size {others}: parallelism.dp_shard = -1 fills whatever --world-size gives "
                 "(none given: the other degrees' product)")
    return others


def _run(argv: list[str]) -> None:
    own, rest = split_flags(argv)
    source = None
    for i, arg in enumerate(rest):
        if arg == "--config" and i + 1 < len(rest):
            source = rest[i + 1]
        elif arg.startswith("--config="):
            source = arg.partition("=")[2]
    cfg = load_config(rest)
    notes: list[str] = []
    world = own["--world-size"] if "--world-size" in own else _default_world(cfg, notes)
    memory, device = own.get("--device-memory"), None
    if memory is not None:
        try:
            memory = float(memory)
        except ValueError:
            memory, device = None, own["--device-memory"]
    result = plan(cfg, world, device_memory_gib=memory, device=device, storage_gbps=own.get("--storage-gbps", 2.0),
                  storage_shared=own.get("--storage-shared", False), source=source)
    result.notes[:0] = notes
    print(json.dumps(result.to_dict(), indent=2) if own.get("--json") else format_plan(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (0 with a plan, 2 for what cannot work)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return exits.DONE
    return exits.run(lambda: _run(argv))


if __name__ == "__main__":
    raise SystemExit(main())

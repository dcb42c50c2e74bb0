"""The configuration's sections: every key, its type, default, help text and allowed values.

Contract: one dataclass per section; every field has an attribute docstring (the string literal
under it), which :mod:`trainer.config.fields` parses for ``--help``, or its help in the field's
metadata (the ``checkpoint`` section's engine options, :mod:`trainer.config.checkpoint`, and
``model.flavor``, whose help lists the flavors of :data:`trainer.flavors.FLAVORS` so it cannot miss one).
:data:`SECTIONS` lists the sections in help/file order and :data:`CHOICES` the fields restricted to
a set of values (the checkpoint ones are the engine's enums from :mod:`ckpt.options`, not a second
list). :func:`is_byte_tokenizer` says what ``model.tokenizer`` names. Nothing here parses or
validates; :class:`trainer.config.Config` composes the sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..flavors import FLAVORS, LLAMA3_FLAVORS
from .checkpoint import CHOICES as CHECKPOINT_CHOICES
from .checkpoint import CheckpointConfig


class ConfigError(ValueError):
    """A configuration file or command-line override that cannot be used."""


def is_byte_tokenizer(path: str | None) -> bool:
    """Whether ``model.tokenizer`` = ``path`` names the built-in byte-level tokenizer (``None``, ``""``
    or ``"byte"``)."""
    return path is None or path in ("", "byte")


@dataclass
class JobConfig:
    """Where the run writes and how it is seeded."""

    dump_folder: str = "outputs/debug"
    """Folder for everything the run writes: metrics.jsonl, TensorBoard logs and (unless
    checkpoint.folder is absolute) the checkpoints."""
    seed: int = 0
    """Random seed for model initialisation and data order (same seed, same run)."""
    description: str = ""
    """Free-form description of the run, recorded with the config in <dump_folder>/config.json and in every checkpoint's manifest."""


@dataclass
class ModelConfig:
    """The model: a llama flavor, optionally with explicit dimensions that override the flavor's."""

    name: str = "llama"
    """Model family (case-insensitive): "llama", or "llama3" (torchtitan's name: then model.flavor
    is one of torchtitan's llama3 flavors, debugmodel, 1B, 3B, 8B, 70B)."""
    flavor: str = field(default="debug", metadata={"help": (
        f"Size preset of the family (case-insensitive): {', '.join(FLAVORS)}; with model.name = llama3, "
        f"torchtitan's names {', '.join(LLAMA3_FLAVORS)} (docs/CONFIG.md lists the shapes; seed key: model.size).")})
    vocab_size: int | None = None
    """Vocabulary size (embedding and output rows); none: the tokenizer's. Smaller than the
    tokenizer's vocabulary is refused (its token ids would not fit)."""
    hidden_dim: int | None = None
    """Model (embedding) dimension; none: the flavor's."""
    n_layers: int | None = None
    """Number of transformer blocks; none: the flavor's."""
    n_heads: int | None = None
    """Number of attention (query) heads; none: the flavor's."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention; none: the flavor's."""
    ffn_dim: int | None = None
    """SwiGLU hidden width (Hugging Face intermediate_size); none: the flavor's, or rounded from
    multiple_of / ffn_dim_multiplier when one of them is given."""
    multiple_of: int | None = None
    """The SwiGLU width is 2/3 of 4*hidden_dim, times ffn_dim_multiplier, rounded up to a multiple of
    this (torchtitan's and Meta's rule); none: the flavor's."""
    ffn_dim_multiplier: float | None = None
    """Multiplier of the SwiGLU width before rounding (Llama-3 8B: 1.3); none: the flavor's."""
    norm_eps: float | None = None
    """RMSNorm epsilon (Hugging Face rms_norm_eps); none: the flavor's (1e-5)."""
    rope_theta: float | None = None
    """Rotary embedding base (Llama-2: 10000, Llama-3: 500000); none: the flavor's."""
    rope_scaling: str | None = None
    """Rotary frequency scaling: "default" (none, Hugging Face's word), or "llama3" (Llama-3.1+ /
    torchtitan's scaling="llama", with the rope_* factors below); none: the flavor's (the llama3
    flavors and debugmodel: llama3)."""
    rope_factor: float | None = None
    """llama3 rope scaling: how much long wavelengths are slowed (Hugging Face rope_scaling.factor); none: the
    flavor's scaling's, else 8."""
    rope_low_freq_factor: float | None = None
    """llama3 rope scaling: low_freq_factor; none: the flavor's scaling's, else 1."""
    rope_high_freq_factor: float | None = None
    """llama3 rope scaling: high_freq_factor; none: the flavor's scaling's, else 4."""
    rope_original_max_positions: int | None = None
    """llama3 rope scaling: original_max_position_embeddings (the context the model was pretrained on);
    none: the flavor's scaling's, else 8192."""
    tie_embeddings: bool | None = None
    """The output projection is the embedding matrix (Hugging Face tie_word_embeddings; Llama-3.2
    1B/3B, SmolLM); none: the flavor's. Not with parallelism.tp or pp above 1."""
    max_seq_len: int | None = None
    """Positions the rotary tables cover, written as max_position_embeddings by --to hf; none:
    the flavor's, or training.seq_len when longer. Must be at least training.seq_len."""
    tokenizer: str | None = None
    """Path to a local tokenizer.json; none: the built-in byte-level tokenizer (no download)."""
    num_experts: int | None = None
    """Mixture of experts: routed experts per block (0: a dense SwiGLU); none: the flavor's
    (moe_debug, moe_small: 8)."""
    top_k: int | None = None
    """Mixture of experts: experts each token is routed to; none: the flavor's (2)."""
    num_shared_experts: int | None = None
    """Mixture of experts: always-on experts beside the routed ones (0 for a Mixtral layout that
    --to hf exports); none: the flavor's (moe_debug 0, moe_small 1)."""
    moe_ffn_dim: int | None = None
    """Mixture of experts: one expert's SwiGLU width; none: the flavor's."""
    moe_aux_loss_coef: float | None = None
    """Mixture of experts: weight of the router's load-balancing loss added to the training loss
    (reported as moe_aux_loss); none: the flavor's (0.01)."""


@dataclass
class TrainingConfig:
    """The optimisation loop: steps, batch, schedule, data and device."""

    steps: int = 100
    """Number of optimizer steps to train for (seed key: training.max_steps)."""
    batch_size: int = 8
    """GLOBAL batch size in sequences per optimizer step, summed over data-parallel ranks and
    accumulation micro-steps: batch_size = micro_batch_size * gradient_accumulation_steps * dp."""
    micro_batch_size: int | None = None
    """Sequences per rank per micro-step (forward/backward); none: derived from batch_size."""
    gradient_accumulation_steps: int | None = None
    """Micro-steps per optimizer step; none: derived (1 unless micro_batch_size forces more)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    lr: float = 3e-4
    """Peak learning rate (AdamW), reached after the warmup."""
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """After warmup the learning rate follows a cosine down to lr * min_lr_ratio at `steps`."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    max_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables clipping."""
    gc_freq: int = 50
    """Python garbage collection: automatic collection is off during training and generations 0-1
    are collected every gc_freq steps on every rank at once (as torchtitan does), so a collection
    never pauses one rank, or the checkpoint writer, at a random moment; 0 leaves it automatic."""
    dataset: str = "shipped"
    """Training text: "shipped" (the small corpus in the project), or a path to a .txt/.jsonl
    file or to a directory of them."""
    device: str = "auto"
    """Device type: auto (npu if torch_npu works, else cuda, else cpu), npu, cuda or cpu."""


@dataclass
class ParallelismConfig:
    """Parallel degrees; their product pp x dp_replicate x dp_shard x cp x tp must equal the world
    size (checked by the parallel layer)."""

    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension; DDP's degree with zero_stage 0)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP2's shard dimension); -1: all ranks left over by the other
    degrees (seed key: distributed.dp_size, with dp_replicate = 1)."""
    tp: int = 1
    """Tensor-parallel degree, with sequence parallelism (seed key: distributed.tp_size)."""
    pp: int = 1
    """Pipeline-parallel degree (seed key: distributed.pp_size)."""
    cp: int = 1
    """Context-parallel degree: every sequence split over this many ranks, attention exchanging
    keys/values (seed key: distributed.cp_size). training.seq_len must be divisible by 2 x cp;
    not with pp above 1."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, or interleaved1f1b (needs pp_virtual_stages >= 2)."""
    pp_microbatches: int | None = None
    """Microbatches each step's batch is split into for the pipeline; none: pp (the least that
    fills it). Must divide the per-rank batch."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (interleaved1f1b: 2 or more; the layers are cut into pp x this)."""
    ep: int = 1
    """Expert-parallel degree (seed key: distributed.ep_size): a mixture of experts' routed experts
    split over ep ranks, tokens exchanged all-to-all. Borrowed from dp_shard (must divide it and
    model.num_experts): it multiplies nothing, the world size is unchanged."""


@dataclass
class OptimizationConfig:
    """Numerics and memory trade-offs."""

    precision: str = "fp32"
    """Compute precision: fp32; bf16 or fp16 (mixed precision: fp32 master weights, optimizer state
    and gradient reduction unless master_dtype / optimizer_state_dtype say otherwise; fp16 adds a
    dynamic loss scaler whose state is checkpointed)."""
    master_dtype: str = "fp32"
    """Dtype of the stored parameters (master weights) and their gradients: fp32, or bf16 (needs
    precision = bf16): 2 bytes each instead of 4; AdamW computes its update in fp32 and writes it
    back with stochastic rounding (unbiased, so updates below bf16's resolution are not lost)."""
    optimizer_state_dtype: str = "fp32"
    """Dtype of AdamW's exp_avg and exp_avg_sq: fp32, or bf16 (4 bytes per parameter instead of 8;
    the update is computed in fp32 one tensor at a time, the moments rounded to nearest)."""
    gradient_checkpointing: bool = False
    """Recompute transformer blocks' activations in backward (saves memory; see ac_every, ac_op_level)."""
    ac_every: int = 1
    """With gradient_checkpointing: checkpoint every n-th block (1: all blocks; 2: every other one)."""
    ac_op_level: bool = False
    """With gradient_checkpointing: keep matmul and attention outputs, recompute only the cheap
    element-wise ops between them (selective op-level checkpointing), instead of whole blocks."""
    cpu_offload: bool = False
    """FSDP2 CPU offload: parameters, gradients and optimizer state live in host memory and the
    optimizer steps there (the seeds' swap optimizer); needs zero_stage >= 1 and dp > 1."""
    zero_stage: int = 3
    """Data-parallel sharding: 0 DDP; 1 or 2 FSDP2 without resharding after forward;
    3 FSDP2 resharding parameters after forward. With one data-parallel rank the model is not
    wrapped (nothing to shard or replicate)."""
    compile: bool = False
    """Apply torch.compile to the model (per transformer block)."""
    accumulate_unsharded: bool | None = None
    """FSDP2 gradient accumulation (micro-steps and pipeline microbatches): true keeps every
    parameter's whole fp32 gradient between micro-steps and reduce-scatters once at the end (least
    communication, 4 bytes per unsharded parameter held); false reduce-scatters every micro-step
    into the sharded gradients (1/dp_shard of that held). none: true for zero_stage 1 (ZeRO-1
    shards only the optimizer state), false for 2 and 3."""
    loss_parallel: bool = True
    """With tensor parallelism: keep the output projection's logits split by vocabulary into the
    cross-entropy (torch's loss_parallel) instead of gathering every token's whole vocabulary on
    every rank."""
    loss_chunk_len: int = 1024
    """Chunked loss: the logits are computed, used and freed this many sequence positions at a time
    (recomputed per chunk in backward); 0, or a sequence no longer than this, computes them all at once."""


@dataclass
class MetricsConfig:
    """What the run reports."""

    log_freq: int = 1
    """Log metrics (stdout and metrics.jsonl) every `log_freq` steps."""
    tensorboard: bool = False
    """Also write TensorBoard scalars under job.dump_folder (if tensorboard is installed)."""


SECTIONS: dict[str, type] = {
    "job": JobConfig,
    "model": ModelConfig,
    "training": TrainingConfig,
    "parallelism": ParallelismConfig,
    "optimization": OptimizationConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
}

# Fields restricted to a set of values (strings are matched case-insensitively and stored lower-case).
CHOICES: dict[tuple[str, str], tuple[Any, ...]] = {
    ("training", "device"): ("auto", "npu", "cuda", "cpu"),
    ("optimization", "precision"): ("fp32", "bf16", "fp16"),
    ("optimization", "zero_stage"): (0, 1, 2, 3),
    ("optimization", "master_dtype"): ("fp32", "bf16"),
    ("optimization", "optimizer_state_dtype"): ("fp32", "bf16"),
    ("parallelism", "pp_schedule"): ("gpipe", "1f1b", "interleaved1f1b"),
    **{("checkpoint", key): values for key, values in CHECKPOINT_CHOICES.items()},
}

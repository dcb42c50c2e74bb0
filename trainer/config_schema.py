"""The configuration's sections: every key, its type, default, help text and allowed values.

Contract: one dataclass per section; every field has an attribute docstring (the string literal
under it), which :mod:`trainer.config_fields` parses for ``--help``. :data:`SECTIONS` lists the
sections in help/file order and :data:`CHOICES` the fields restricted to a set of values (the
checkpoint ones are the engine's enums from :mod:`ckpt.options`, not a second list). Nothing here
parses or validates; :class:`trainer.config.Config` composes the sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt.options import AsyncMode, Compression, FailurePolicy, SaveOptions, choices


class ConfigError(ValueError):
    """A configuration file or command-line override that cannot be used."""


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
    """Model family (case-insensitive; only "llama" is implemented)."""
    flavor: str = "debug"
    """Size preset of the family, e.g. "debug", "7B", "13B", "70B" (seed key: model.size)."""
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
    tokenizer: str | None = None
    """Path to a local tokenizer.json; none: the built-in byte-level tokenizer (no download)."""


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
    """Parallel degrees; their product must equal the world size (checked by the parallel layer)."""

    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension; DDP's degree with zero_stage 0)."""
    dp_shard: int = -1
    """Data-parallel shards (FSDP2's shard dimension); -1: all ranks left over by the other
    degrees (seed key: distributed.dp_size, with dp_replicate = 1)."""
    tp: int = 1
    """Tensor-parallel degree, with sequence parallelism (seed key: distributed.tp_size)."""
    pp: int = 1
    """Pipeline-parallel degree (seed key: distributed.pp_size)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, or interleaved1f1b (needs pp_virtual_stages >= 2)."""
    pp_microbatches: int | None = None
    """Microbatches each step's batch is split into for the pipeline; none: pp (the least that
    fills it). Must divide the per-rank batch."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (interleaved1f1b: 2 or more; the layers are cut into pp x this)."""


@dataclass
class OptimizationConfig:
    """Numerics and memory trade-offs."""

    precision: str = "fp32"
    """Compute precision: fp32; bf16 or fp16 (mixed precision: fp32 master weights, optimizer state
    and gradient reduction; fp16 adds a dynamic loss scaler whose state is checkpointed)."""
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


@dataclass
class CheckpointConfig:
    """Checkpointing through ckpt.CheckpointManager."""

    enable: bool = False
    """Save checkpoints and resume from them."""
    folder: str = "checkpoints"
    """Checkpoint folder (the primary mount), relative to job.dump_folder unless absolute or a URL
    such as s3://bucket/run (credentials from the standard AWS environment variables)."""
    replicas: list[str] = field(default_factory=list)
    """Further mounts every committed checkpoint is copied to in the background (directories on a
    shared file system, s3://bucket/prefix URLs); resuming falls back to them when the primary's
    copy is missing or damaged. On the command line: comma-separated."""
    replica_read_back: bool = False
    """After copying a checkpoint to a replica, read it back and verify every checksum (default:
    sizes are checked)."""
    close_timeout: float = 300.0
    """Seconds the end of the run waits for pending replication."""
    interval: int = 10
    """Save at every step that is a multiple of `interval`."""
    async_mode: str = AsyncMode.DOUBLE_BUFFER.value
    """double_buffer: stage to host buffers and write in the background; sync: write inline."""
    keep: int = 3
    """Number of newest committed checkpoints to keep."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this; none: only the newest `keep`."""
    full_every: int = 1
    """Incremental checkpoints: a full checkpoint, then up to full_every-1 lossless deltas (1: always full)."""
    compress: str = Compression.NONE.value
    """none: store full checkpoints raw; zstd: as zstd-compressed byte planes (deltas always are)."""
    zstd_level: int = 1
    """zstd level for deltas and compressed fulls."""
    on_error: str = FailurePolicy.STOP.value
    """What a failed save (disk full, folder not writable) does. stop: the run exits with code 1
    as soon as the failure is known (the next step, or the end), keeping every checkpoint committed before; a restart resumes from the
    newest of them and, if the same save fails again, exits at it again. continue: the run warns,
    counts the failure (ckpt_failures in the metrics) and trains on; the next interval retries
    as a full checkpoint, and the steps it could not write are simply missing (a restart resumes
    from the newest one that was written). A create_seed_checkpoint run always stops."""
    load_step: int | None = None
    """Step to resume from (needs enable); none: the latest committed step, if any. A step that
    is not committed is refused, naming the committed ones."""
    create_seed_checkpoint: bool = False
    """Initialise the model, save it as step 0 and exit (run with a single process)."""
    initial_load_path: str | None = None
    """A checkpoint to take the model's weights from when the run has no checkpoint of its own yet:
    a checkpoint directory, or a root (its newest committed step); a path (relative to the working
    directory) or a URL. E.g. the output of `ckpt-convert HF_DIR DST --from hf`. Only the weights
    are loaded (the tensors under "model."; every one the model has must be there, in its shape and
    dtype): the optimizer, learning-rate schedule and data position start fresh. Ignored once the
    run has a checkpoint in checkpoint.folder (it resumes from that); works with checkpoint.enable
    false too; with create_seed_checkpoint the seed holds these weights."""

    def save_options(self, *, device_type: str | None, user_metadata: dict) -> SaveOptions:
        """The engine's :class:`~ckpt.options.SaveOptions` for this section (after validation).

        ``device_type`` is the staging device ("cuda"/"npu"/"cpu"; None: the accelerator in use)
        and ``user_metadata`` the JSON-able dict recorded in every manifest.
        """
        return SaveOptions(
            interval=self.interval, keep=self.keep, keep_every=self.keep_every, async_mode=self.async_mode,
            on_error=self.on_error, full_every=self.full_every, compress=self.compress,
            zstd_level=self.zstd_level, device_type=device_type, user_metadata=user_metadata,
            replicas=tuple(self.replicas), replica_read_back=self.replica_read_back,
            close_timeout=self.close_timeout)


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
    ("parallelism", "pp_schedule"): ("gpipe", "1f1b", "interleaved1f1b"),
    ("checkpoint", "async_mode"): choices(AsyncMode),
    ("checkpoint", "compress"): choices(Compression),
    ("checkpoint", "on_error"): choices(FailurePolicy),
}

"""Validation of a whole configuration: types, allowed values and ranges.

Contract: :func:`validate` re-coerces every field to its annotated type (so a Config built by hand
is checked like a parsed one), lower-cases the choice strings, and raises :class:`ConfigError`
``section.key=value is invalid: requirement`` for the first value out of range (the model's
shapes through :func:`trainer.config.derive.model_args`, against the byte tokenizer's vocabulary
when that is the tokenizer; a tokenizer.json is checked once loaded); the model's sizes are bounded
by :mod:`trainer.config.limits`, so an absurd one is refused before anything is built of it. Nothing here
rejects what only the parallel layer can judge (``tp``/``pp`` above 1, HSDP with DDP, degrees
against the world size); :mod:`trainer.parallel` does that.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckpt.errors import InvalidOptionError
from .derive import FAMILIES, model_args
from .fields import coerce
from .limits import MAX_SEQ_LEN, MODEL_LIMITS
from .schema import CHOICES, SECTIONS, ConfigError, is_byte_tokenizer
from ..model import BYTE_VOCAB_SIZE


def _fail(section: str, key: str, value: Any, requirement: str) -> None:
    raise ConfigError(f"{section}.{key}={value!r} is invalid: {requirement}")


def validate(cfg: Any) -> None:
    """Raise ConfigError naming the first key of ``cfg`` (a :class:`trainer.config.Config`) whose
    value is out of range."""
    for section, cls in SECTIONS.items():
        obj = getattr(cfg, section)
        if not isinstance(obj, cls):
            raise ConfigError(f"section {section} must be a {cls.__name__}, got {type(obj).__name__}")
        for f in dataclasses.fields(cls):  # types (also for Configs built by hand)
            setattr(obj, f.name, coerce(section, f.name, getattr(obj, f.name)))
    for (section, key), choices in CHOICES.items():
        obj = getattr(cfg, section)
        value = getattr(obj, key)
        if isinstance(value, str):
            value = value.strip().lower()
            setattr(obj, key, value)
        if value not in choices:
            _fail(section, key, value, f"must be one of {', '.join(map(str, choices))}")

    j, m, t, p, c = cfg.job, cfg.model, cfg.training, cfg.parallelism, cfg.checkpoint
    if j.seed < 0:
        _fail("job", "seed", j.seed, "must be >= 0")
    if not j.dump_folder:
        _fail("job", "dump_folder", j.dump_folder, "must not be empty")
    if m.name.lower() not in FAMILIES:
        _fail("model", "name", m.name, 'must be "llama" or "llama3" (torchtitan\'s name for the llama-3 flavors)')
    if not m.flavor:
        _fail("model", "flavor", m.flavor, "must not be empty")
    for key in ("vocab_size", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "multiple_of",
                "max_seq_len", "rope_original_max_positions", "top_k", "moe_ffn_dim"):
        v = getattr(m, key)
        if v is not None and v < 1:
            _fail("model", key, v, "must be >= 1 (or none for the flavor's)")
        if v is not None and key in MODEL_LIMITS and v > MODEL_LIMITS[key]:
            _fail("model", key, v, f"must be at most {MODEL_LIMITS[key]} (far beyond any llama; refused before "
                                   "anything is built of it)")
    for key in ("num_experts", "num_shared_experts"):
        if getattr(m, key) is not None and not 0 <= getattr(m, key) <= 1024:
            _fail("model", key, getattr(m, key), "must be in [0, 1024] (or none for the flavor's)")
    if m.moe_aux_loss_coef is not None and m.moe_aux_loss_coef < 0:
        _fail("model", "moe_aux_loss_coef", m.moe_aux_loss_coef, "must be >= 0 (or none for the flavor's)")
    for key in ("ffn_dim_multiplier", "norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
                "rope_high_freq_factor"):
        v = getattr(m, key)
        if v is not None and v <= 0:
            _fail("model", key, v, "must be > 0 (or none for the flavor's)")
    if m.ffn_dim is not None and (m.multiple_of is not None or m.ffn_dim_multiplier is not None):
        _fail("model", "ffn_dim", m.ffn_dim, "sets the SwiGLU width itself: leave multiple_of and "
              "ffn_dim_multiplier none (they round a width derived from hidden_dim)")
    if m.hidden_dim is not None and m.n_heads is not None and m.hidden_dim % m.n_heads:
        _fail("model", "hidden_dim", m.hidden_dim, f"must be divisible by model.n_heads={m.n_heads}")
    if m.n_heads is not None and m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        _fail("model", "n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")

    for key in ("steps", "batch_size", "seq_len"):
        if getattr(t, key) < 1:
            _fail("training", key, getattr(t, key), "must be >= 1")
    if t.seq_len > MAX_SEQ_LEN:
        _fail("training", "seq_len", t.seq_len, f"must be at most {MAX_SEQ_LEN}")
    for key in ("micro_batch_size", "gradient_accumulation_steps"):
        v = getattr(t, key)
        if v is not None and v < 1:
            _fail("training", key, v, "must be >= 1 (or none to derive it)")
    if t.lr <= 0:
        _fail("training", "lr", t.lr, "must be > 0")
    if t.warmup_steps < 0:
        _fail("training", "warmup_steps", t.warmup_steps, "must be >= 0")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        _fail("training", "min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    if t.weight_decay < 0:
        _fail("training", "weight_decay", t.weight_decay, "must be >= 0")
    if t.max_norm < 0:
        _fail("training", "max_norm", t.max_norm, "must be >= 0 (0 disables clipping)")
    if t.gc_freq < 0:
        _fail("training", "gc_freq", t.gc_freq, "must be >= 0 (0 leaves collection automatic)")
    if not t.dataset:
        _fail("training", "dataset", t.dataset, 'must be "shipped" or a path')
    model_args(cfg, BYTE_VOCAB_SIZE if is_byte_tokenizer(m.tokenizer) else None)  # the shapes fit together

    for key in ("dp_replicate", "tp", "pp", "cp", "ep"):
        if getattr(p, key) < 1:
            _fail("parallelism", key, getattr(p, key), "must be >= 1")
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        _fail("parallelism", "cp", p.cp, f"needs training.seq_len ({t.seq_len}) divisible by 2 x cp = {2 * p.cp}")
    if p.cp > 1 and p.pp > 1:
        _fail("parallelism", "cp", p.cp, f"is not supported with parallelism.pp = {p.pp} above 1 yet")
    o = cfg.optimization
    if o.ac_every < 1:
        _fail("optimization", "ac_every", o.ac_every, "must be >= 1")
    if o.loss_chunk_len < 0:
        _fail("optimization", "loss_chunk_len", o.loss_chunk_len, "must be >= 0 (0: the whole sequence at once)")
    if o.master_dtype == "bf16" and o.precision != "bf16":
        _fail("optimization", "master_dtype", o.master_dtype, f"needs optimization.precision = bf16 (not {o.precision})")
    if p.pp_virtual_stages < 1:
        _fail("parallelism", "pp_virtual_stages", p.pp_virtual_stages, "must be >= 1")
    if p.pp_microbatches is not None and p.pp_microbatches < 1:
        _fail("parallelism", "pp_microbatches", p.pp_microbatches, "must be >= 1 (or none for pp)")
    if model_args(cfg, None).tie_embeddings and (p.tp > 1 or p.pp > 1):
        _fail("model", "tie_embeddings", True, f"is not supported with parallelism.tp={p.tp} / pp={p.pp} above 1 "
              "(the embedding and the output projection are split differently, or live on different stages)")
    if p.dp_shard != -1 and p.dp_shard < 1:
        _fail("parallelism", "dp_shard", p.dp_shard, "must be >= 1, or -1 for all remaining ranks")

    if not c.folder:
        _fail("checkpoint", "folder", c.folder, "must not be empty")
    try:  # the engine's rules for what the section hands to it
        c.save_options(device_type=None, user_metadata={})
    except InvalidOptionError as exc:
        _fail("checkpoint", exc.option, exc.value, exc.requirement)
    if c.load_step is not None and c.load_step < 0:
        _fail("checkpoint", "load_step", c.load_step, "must be >= 0 (or none for the latest)")
    if c.load_step is not None and not c.enable:
        _fail("checkpoint", "load_step", c.load_step, "needs checkpoint.enable = true (nothing is loaded otherwise)")

    if cfg.metrics.log_freq < 1:
        _fail("metrics", "log_freq", cfg.metrics.log_freq, "must be >= 1")

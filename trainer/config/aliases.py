"""The seed's YAML keys, accepted as aliases of native fields in files and on the command line.

==============================  =======================================================
seed key                        native field
==============================  =======================================================
``model.size``                  ``model.flavor``
``training.max_steps``          ``training.steps``
``distributed.tp_size``         ``parallelism.tp``
``distributed.pp_size``         ``parallelism.pp``
``distributed.cp_size``         ``parallelism.cp``
``distributed.dp_size``         ``parallelism.dp_shard`` (and ``parallelism.dp_replicate = 1``)
``distributed.ep_size``         ``parallelism.ep``
==============================  =======================================================

torchtitan's keys (:data:`TORCHTITAN_KEYS`; its TOML files and ``--section.key`` flags) are accepted
where they mean what a native key means, some in torchtitan's own sections (``optimizer``,
``lr_scheduler``, ``compile``, ``debug``: :data:`TORCHTITAN_SECTIONS`), with their values translated
where torchtitan spells them otherwise (:func:`translate`: ``async_mode = "async"``,
``mixed_precision_param = "bfloat16"``, ``keep_latest_k = 0``); the rest are listed, with why, in
docs/MIGRATING_FROM_TORCHTITAN.md.

Contract: :func:`native` maps a spelling to the (section, key) it sets; the parser checks that an
alias and its native key in one source agree. ``dp_size`` is the total data-parallel degree,
``dp_replicate * dp_shard``: :func:`merge_dp_size` maps it to a pure sharded layout
(``dp_shard = dp_size``, ``dp_replicate = 1``), or, when the same source also sets
``parallelism.dp_replicate``/``dp_shard``, requires their product to equal it and keeps them.
"""

from __future__ import annotations

from typing import Any

from .fields import coerce
from .schema import ConfigError

SEED_SECTION = "distributed"
"""The seed's section that has no native counterpart of its own (its keys set ``parallelism``)."""

# Seed-style keys inside native sections: (section, alias) -> native key.
KEY_ALIASES: dict[tuple[str, str], str] = {
    ("model", "size"): "flavor",
    ("training", "max_steps"): "steps",
}

# The seed's `distributed` section: key -> parallelism key.
DISTRIBUTED_KEYS: dict[str, str] = {"tp_size": "tp", "pp_size": "pp", "dp_size": "dp_shard", "cp_size": "cp",
                                    "ep_size": "ep"}

SEED_SECTION_NOTE = f"{SEED_SECTION} (seed style: {', '.join(DISTRIBUTED_KEYS)})"
"""How the seed section is listed among the valid sections."""

# torchtitan's keys (0.3.0's Trainer.Config, and the TOML files of its earlier releases) that mean
# what a native key means: (section, torchtitan key) -> native (section, key).
TORCHTITAN_KEYS: dict[tuple[str, str], tuple[str, str]] = {
    ("checkpoint", "keep_latest_k"): ("checkpoint", "keep"),
    ("checkpoint", "enable_checkpoint"): ("checkpoint", "enable"),
    ("parallelism", "data_parallel_shard_degree"): ("parallelism", "dp_shard"),
    ("parallelism", "data_parallel_replicate_degree"): ("parallelism", "dp_replicate"),
    ("parallelism", "tensor_parallel_degree"): ("parallelism", "tp"),
    ("parallelism", "pipeline_parallel_degree"): ("parallelism", "pp"),
    ("parallelism", "context_parallel_degree"): ("parallelism", "cp"),
    ("parallelism", "pipeline_parallel_schedule"): ("parallelism", "pp_schedule"),
    ("training", "local_batch_size"): ("training", "micro_batch_size"),
    ("training", "global_batch_size"): ("training", "batch_size"),
    ("training", "enable_cpu_offload"): ("optimization", "cpu_offload"),
    ("training", "mixed_precision_param"): ("optimization", "precision"),
    ("training", "seed"): ("job", "seed"),
    ("training", "compile"): ("optimization", "compile"),
    ("optimizer", "lr"): ("training", "lr"),
    ("optimizer", "weight_decay"): ("training", "weight_decay"),
    ("lr_scheduler", "warmup_steps"): ("training", "warmup_steps"),
    ("lr_scheduler", "min_lr_factor"): ("training", "min_lr_ratio"),
    ("metrics", "enable_tensorboard"): ("metrics", "tensorboard"),
    ("model", "hf_assets_path"): ("model", "tokenizer"),
    ("model", "tokenizer_path"): ("model", "tokenizer"),
    ("compile", "enable"): ("optimization", "compile"),
    ("debug", "seed"): ("job", "seed"),
}
TORCHTITAN_SECTIONS = tuple(sorted({s for s, _ in TORCHTITAN_KEYS} - {"checkpoint", "parallelism", "training",
                                                                     "metrics", "model", "job"}))
"""torchtitan's sections without a native counterpart (their keys set native ones)."""

KEEP_ALL = 10**9
"""``checkpoint.keep`` for torchtitan's ``keep_latest_k = 0`` (keep every checkpoint)."""


def translate(section: str, key: str, spelled: str, raw):
    """A value as the native ``section.key`` takes it, from a torchtitan spelling ``spelled``
    (``async_mode`` "disabled"/"async"/"async_with_pinned_mem", ``mixed_precision_param``
    "bfloat16"/"float32", ``keep_latest_k = 0``); other values as they are."""
    text = raw.strip().lower() if isinstance(raw, str) else raw
    if (section, key) == ("checkpoint", "async_mode"):
        return {"disabled": "sync", "async": "double_buffer", "async_with_pinned_mem": "double_buffer"}.get(text, raw)
    if spelled == "training.mixed_precision_param":
        return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(text, raw)
    if spelled == "checkpoint.keep_latest_k" and text in (0, "0"):
        return KEEP_ALL
    if spelled == "training.global_batch_size" and text in (-1, "-1"):
        raise ConfigError("training.global_batch_size = -1 (torchtitan: local_batch_size x data-parallel degree) "
                          "has no counterpart: set training.batch_size, the global batch, to that product")
    return raw


def is_section(section: str) -> bool:
    """Whether ``section`` is an alias section (the seed's ``distributed``, torchtitan's own)."""
    return section == SEED_SECTION or section in TORCHTITAN_SECTIONS


def is_alias(section: str, key: str) -> bool:
    """Whether ``section.key`` is a seed-style or torchtitan spelling."""
    return ((section == SEED_SECTION and key in DISTRIBUTED_KEYS) or (section, key) in KEY_ALIASES
            or (section, key) in TORCHTITAN_KEYS)


def native(section: str, key: str) -> tuple[str, str]:
    """The native (section, key) that ``section.key`` sets (itself unless it is an alias)."""
    if section == SEED_SECTION:
        return "parallelism", DISTRIBUTED_KEYS[key]
    if (section, key) in TORCHTITAN_KEYS:
        return TORCHTITAN_KEYS[(section, key)]
    return section, KEY_ALIASES.get((section, key), key)


def valid_aliases(section: str) -> list[str]:
    """The seed-style and torchtitan keys of ``section``, as listed in unknown-key errors."""
    if section == SEED_SECTION:
        return list(DISTRIBUTED_KEYS)
    return ([f"{a} (= {k})" for (s, a), k in KEY_ALIASES.items() if s == section]
            + [f"{a} (torchtitan: = {'.'.join(k)})" for (s, a), k in TORCHTITAN_KEYS.items() if s == section])


def dp_size(raw: Any, where: str) -> int:
    """``distributed.dp_size`` as given in ``where``: an integer >= 1."""
    try:
        value = coerce("parallelism", "dp_shard", raw)
    except ConfigError:
        raise ConfigError(f"{where}: distributed.dp_size expects an integer, got {raw!r}") from None
    if value is None or value < 1:
        raise ConfigError(f"{where}: distributed.dp_size must be >= 1, got {value}")
    return value


def merge_dp_size(par: dict[str, Any], size: int, where: str) -> None:
    """Set ``dp_replicate``/``dp_shard`` in one source's ``parallelism`` values ``par`` from dp_size."""
    rep, shard = par.get("dp_replicate"), par.get("dp_shard")
    if rep is None and shard is None:
        par["dp_replicate"], par["dp_shard"] = 1, size
        return
    rep = 1 if rep is None else rep
    if shard is None:
        if size % rep:
            raise ConfigError(f"{where}: distributed.dp_size={size} is not divisible by parallelism.dp_replicate={rep}")
        shard = size // rep
    if rep * shard != size:
        raise ConfigError(
            f"{where}: distributed.dp_size={size} must equal parallelism.dp_replicate={rep} x "
            f"parallelism.dp_shard={shard} = {rep * shard}"
        )
    par["dp_replicate"], par["dp_shard"] = rep, shard


def help_lines() -> list[str]:
    """The seed-style keys for ``--help``."""
    lines = ["Seed-style keys (accepted in files and on the command line):"]
    for (section, alias), key in KEY_ALIASES.items():
        lines.append(f"  --{section}.{alias}  = --{section}.{key}")
    for alias, key in DISTRIBUTED_KEYS.items():
        extra = " (with parallelism.dp_replicate = 1: the total data-parallel degree)" if alias == "dp_size" else ""
        lines.append(f"  --{SEED_SECTION}.{alias}  = --parallelism.{key}{extra}")
    lines += ["", "torchtitan's keys (accepted in files and on the command line; docs/MIGRATING_FROM_TORCHTITAN.md):"]
    for (section, alias), (to_section, key) in TORCHTITAN_KEYS.items():
        lines.append(f"  --{section}.{alias}  = --{to_section}.{key}")
    return lines

"""Trainer configuration: nested dataclasses, TOML/YAML files, ``--section.key value`` overrides.

Precedence is defaults < config file < command line.  A file is read by its extension
(``.toml`` with :mod:`tomllib`, ``.yaml``/``.yml`` with ``yaml.safe_load``).  Every field has an
attribute docstring (the string literal under it); they are parsed with :mod:`ast` at import time
and make up :func:`help_text`.

The seed's YAML keys are accepted as aliases and mapped onto the native fields:

==============================  =======================================================
seed key                        native field
==============================  =======================================================
``model.size``                  ``model.flavor``
``training.max_steps``          ``training.steps``
``distributed.tp_size``         ``parallelism.tp``
``distributed.pp_size``         ``parallelism.pp``
``distributed.dp_size``         ``parallelism.dp_shard`` (and ``parallelism.dp_replicate = 1``)
==============================  =======================================================

``dp_size`` is the total data-parallel degree, ``dp_replicate * dp_shard``; it is mapped to a pure
sharded layout (``dp_shard = dp_size``, ``dp_replicate = 1``).  If the same source also sets
``parallelism.dp_replicate``/``dp_shard`` explicitly, their product must equal ``dp_size`` and the
explicit values are used.  An alias and its native key in the same source must agree.

Nothing here rejects values that only the parallel layer can judge (``tp``/``pp`` above 1, HSDP with
DDP, degrees against the world size); :mod:`trainer.parallel` does that.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "JobConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizationConfig",
    "ParallelismConfig",
    "TrainingConfig",
    "help_text",
    "load_config",
]


class ConfigError(ValueError):
    """A configuration file or command-line override that cannot be used."""


# --------------------------------------------------------------------------------------- sections


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
    """Vocabulary size; none: the flavor's, or the tokenizer's when the flavor leaves it open."""
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


@dataclass
class OptimizationConfig:
    """Numerics and memory trade-offs."""

    precision: str = "fp32"
    """Parameter/compute precision: fp32, or bf16 (mixed precision, fp32 gradient reduction)."""
    gradient_checkpointing: bool = False
    """Recompute every transformer block's activations in backward (saves memory)."""
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
    """Checkpoint folder, relative to job.dump_folder unless absolute (or a URL)."""
    interval: int = 10
    """Save at every step that is a multiple of `interval`."""
    async_mode: str = "double_buffer"
    """double_buffer: stage to host buffers and write in the background; sync: write inline."""
    keep: int = 3
    """Number of newest committed checkpoints to keep."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this; none: only the newest `keep`."""
    full_every: int = 1
    """Incremental checkpoints: a full checkpoint, then up to full_every-1 lossless deltas (1: always full)."""
    compress: str = "none"
    """none: store full checkpoints raw; zstd: as zstd-compressed byte planes (deltas always are)."""
    zstd_level: int = 1
    """zstd level for deltas and compressed fulls."""
    load_step: int | None = None
    """Step to resume from; none: the latest committed step, if any."""
    create_seed_checkpoint: bool = False
    """Initialise the model, save it as step 0 and exit (run with a single process)."""


@dataclass
class MetricsConfig:
    """What the run reports."""

    log_freq: int = 1
    """Log metrics (stdout and metrics.jsonl) every `log_freq` steps."""
    tensorboard: bool = False
    """Also write TensorBoard scalars under job.dump_folder (if tensorboard is installed)."""


# ------------------------------------------------------------------------------------ top level

_SECTIONS: dict[str, type] = {
    "job": JobConfig,
    "model": ModelConfig,
    "training": TrainingConfig,
    "parallelism": ParallelismConfig,
    "optimization": OptimizationConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
}

# Fields restricted to a set of values (strings are matched case-insensitively and stored lower-case).
_CHOICES: dict[tuple[str, str], tuple[Any, ...]] = {
    ("training", "device"): ("auto", "npu", "cuda", "cpu"),
    ("optimization", "precision"): ("fp32", "bf16"),
    ("optimization", "zero_stage"): (0, 1, 2, 3),
    ("checkpoint", "async_mode"): ("double_buffer", "sync"),
    ("checkpoint", "compress"): ("none", "zstd"),
}

# Seed-style keys inside native sections: (section, alias) -> native key.
_KEY_ALIASES: dict[tuple[str, str], str] = {
    ("model", "size"): "flavor",
    ("training", "max_steps"): "steps",
}

# The seed's `distributed` section: key -> parallelism key.
_DISTRIBUTED_KEYS: dict[str, str] = {"tp_size": "tp", "pp_size": "pp", "dp_size": "dp_shard"}


@dataclass
class Config:
    """The whole trainer configuration."""

    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The nested dict {section: {key: value}} with native keys (JSON/TOML-friendly values)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """Build from a nested dict (e.g. ``to_dict()`` output or a parsed file); validated."""
        cfg = cls()
        _apply(cfg, _normalize(data, "dict"))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ConfigError naming the first key whose value is out of range."""
        _validate(self)

    def resolve_batch(self, dp_degree: int) -> tuple[int, int]:
        """(micro_batch_size, gradient_accumulation_steps) for a data-parallel degree.

        They satisfy ``batch_size == micro_batch_size * gradient_accumulation_steps * dp_degree``.
        Missing values are derived (accumulation defaults to 1); inconsistent or non-divisible
        combinations raise ConfigError with the arithmetic spelled out.
        """
        if isinstance(dp_degree, bool) or not isinstance(dp_degree, int) or dp_degree < 1:
            raise ConfigError(f"data-parallel degree must be a positive integer, not {dp_degree!r}")
        t = self.training
        b, m, g, dp = t.batch_size, t.micro_batch_size, t.gradient_accumulation_steps, dp_degree
        if m is not None and g is not None:
            if m * g * dp != b:
                raise ConfigError(
                    f"training.batch_size={b} must equal training.micro_batch_size={m} x "
                    f"training.gradient_accumulation_steps={g} x data-parallel degree {dp} = {m * g * dp}"
                )
            return m, g
        if m is not None:
            if b % (m * dp):
                raise ConfigError(
                    f"training.batch_size={b} is not divisible by training.micro_batch_size={m} x "
                    f"data-parallel degree {dp} = {m * dp}, so no gradient_accumulation_steps fits"
                )
            return m, b // (m * dp)
        g = 1 if g is None else g
        if b % (g * dp):
            raise ConfigError(
                f"training.batch_size={b} is not divisible by training.gradient_accumulation_steps={g} x "
                f"data-parallel degree {dp} = {g * dp}, so no micro_batch_size fits"
            )
        return b // (g * dp), g


# ---------------------------------------------------------------------------------- field docs


def _parse_field_docs() -> dict[str, dict[str, str]]:
    """{class name: {field: attribute docstring}} from this module's source."""
    try:
        with open(__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, TypeError):  # pragma: no cover - running without sources
        return {}
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        per: dict[str, str] = {}
        body = node.body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                per[stmt.target.id] = " ".join(nxt.value.value.split())
        docs[node.name] = per
    return docs


_FIELD_DOCS = _parse_field_docs()


def field_help(section: str, key: str) -> str:
    """The help text of ``section.key`` (its attribute docstring)."""
    return _FIELD_DOCS.get(_SECTIONS[section].__name__, {}).get(key, "")


# -------------------------------------------------------------------------------------- typing

_HINTS: dict[str, dict[str, Any]] = {name: typing.get_type_hints(cls) for name, cls in _SECTIONS.items()}


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(base type, optional?) for ``X`` or ``X | None``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:  # pragma: no cover - not used by the sections
            raise TypeError(f"unsupported annotation {tp!r}")
        return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _split_optional(tp)
    return base.__name__ + ("|none" if optional else "")


_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


def _coerce(section: str, key: str, value: Any) -> Any:
    """Convert ``value`` (from a file or the command line) to the annotated type of section.key."""
    base, optional = _split_optional(_HINTS[section][key])
    name = f"{section}.{key}"
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{name} cannot be none (expected {base.__name__})")
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ConfigError(f"{name} expects a boolean (true/false/1/0/yes/no), got {value!r}")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip(), 10)
            except ValueError:
                pass
        raise ConfigError(f"{name} expects an integer, got {value!r}")
    if base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif isinstance(value, str):  # PyYAML reads `1e-4` as a string
            try:
                out = float(value.strip())
            except ValueError:
                raise ConfigError(f"{name} expects a number, got {value!r}") from None
        else:
            raise ConfigError(f"{name} expects a number, got {value!r}")
        if not math.isfinite(out):
            raise ConfigError(f"{name} must be finite, got {value!r}")
        return out
    if base is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} expects a string, got {value!r} ({type(value).__name__})")
    raise TypeError(f"unsupported annotation for {name}: {base!r}")  # pragma: no cover


# ----------------------------------------------------------------------- sources → native dicts


def _valid_sections() -> str:
    return ", ".join(list(_SECTIONS) + ["distributed (seed style: tp_size, pp_size, dp_size)"])


def _valid_keys(section: str) -> str:
    if section == "distributed":
        return ", ".join(_DISTRIBUTED_KEYS)
    keys = [f.name for f in dataclasses.fields(_SECTIONS[section])]
    aliases = [f"{a} (= {k})" for (s, a), k in _KEY_ALIASES.items() if s == section]
    return ", ".join(keys + aliases)


def _check_key(section: str, key: str, where: str) -> None:
    if section not in _SECTIONS and section != "distributed":
        raise ConfigError(f"unknown section {section!r} in {where}; valid sections: {_valid_sections()}")
    if section == "distributed":
        ok = key in _DISTRIBUTED_KEYS
    else:
        ok = key in _HINTS[section] or (section, key) in _KEY_ALIASES
    if not ok:
        raise ConfigError(f"unknown key {section}.{key} in {where}; valid keys of [{section}]: {_valid_keys(section)}")


def _normalize(data: Any, where: str) -> dict[str, dict[str, Any]]:
    """Map one source's {section: {key: value}} (aliases allowed) to coerced native values."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(data).__name__}")
    out: dict[str, dict[str, Any]] = {}
    # (section, native key) -> (spelling used, value) to detect an alias disagreeing with its key
    seen: dict[tuple[str, str], tuple[str, Any]] = {}

    def put(section: str, key: str, spelled: str, raw: Any) -> None:
        try:
            value = _coerce(section, key, raw)
        except ConfigError as e:
            given = "" if spelled == f"{section}.{key}" else f" (given as {spelled})"
            raise ConfigError(f"{where}: {e}{given}") from None
        prev = seen.get((section, key))
        if prev is not None and prev[1] != value:
            raise ConfigError(
                f"{where}: {prev[0]}={prev[1]!r} and {spelled}={value!r} set the same option "
                f"{section}.{key} differently"
            )
        seen[(section, key)] = (spelled, value)
        out.setdefault(section, {})[key] = value

    dp_size: int | None = None
    for section, body in data.items():
        if not isinstance(section, str):
            raise ConfigError(f"{where}: section names must be strings, got {section!r}")
        if section not in _SECTIONS and section != "distributed":
            raise ConfigError(f"unknown section {section!r} in {where}; valid sections: {_valid_sections()}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: section [{section}] must be a mapping of keys, got {body!r}")
        for key, raw in body.items():
            key = str(key)
            _check_key(section, key, where)
            if section == "distributed":
                native = _DISTRIBUTED_KEYS[key]
                if native == "dp_shard":
                    try:
                        dp_size = _coerce("parallelism", "dp_shard", raw)
                    except ConfigError:
                        raise ConfigError(f"{where}: distributed.dp_size expects an integer, got {raw!r}") from None
                    if dp_size is None or dp_size < 1:
                        raise ConfigError(f"{where}: distributed.dp_size must be >= 1, got {dp_size}")
                    continue
                put("parallelism", native, f"distributed.{key}", raw)
            else:
                native = _KEY_ALIASES.get((section, key), key)
                put(section, native, f"{section}.{key}", raw)

    if dp_size is not None:
        par = out.setdefault("parallelism", {})
        rep, shard = par.get("dp_replicate"), par.get("dp_shard")
        if rep is None and shard is None:
            par["dp_replicate"], par["dp_shard"] = 1, dp_size
        else:
            rep = 1 if rep is None else rep
            if shard is None:
                if dp_size % rep:
                    raise ConfigError(
                        f"{where}: distributed.dp_size={dp_size} is not divisible by parallelism.dp_replicate={rep}"
                    )
                shard = dp_size // rep
            if rep * shard != dp_size:
                raise ConfigError(
                    f"{where}: distributed.dp_size={dp_size} must equal parallelism.dp_replicate={rep} x "
                    f"parallelism.dp_shard={shard} = {rep * shard}"
                )
            par["dp_replicate"], par["dp_shard"] = rep, shard
    return out


def _apply(cfg: Config, values: dict[str, dict[str, Any]]) -> None:
    for section, body in values.items():
        obj = getattr(cfg, section)
        for key, value in body.items():
            setattr(obj, key, value)


def _read_file(path: str) -> Any:
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"config file {path!r}: unsupported extension {ext or '(none)'!r}; use .toml, .yaml or .yml")
    try:
        if ext == ".toml":
            try:
                import tomllib
            except ImportError:  # pragma: no cover - Python 3.10
                import tomli as tomllib

            with open(path, "rb") as f:
                return tomllib.load(f)
        import yaml

        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e}") from e
    except ImportError as e:  # pragma: no cover - pyyaml missing
        raise ConfigError(f"reading {path!r} needs PyYAML (pip install pyyaml): {e}") from e
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise ConfigError(f"cannot parse config file {path!r}: {e}") from e


def _parse_cli(argv: list[str]) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """(config path, {section: {key: raw string}}) from ``--config P --section.key value ...``."""
    path: str | None = None
    raw: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected command-line argument {arg!r}; expected --config PATH or --section.key value "
                f"(sections: {_valid_sections()})"
            )
        name, eq, value = arg[2:].partition("=")
        if name == "config":
            if not eq:
                if i >= len(argv):
                    raise ConfigError("--config needs a path")
                value, i = argv[i], i + 1
            path = value
            continue
        section, dot, key = name.partition(".")
        if not dot or not key or "." in key:
            raise ConfigError(
                f"unexpected command-line argument {arg!r}; expected --section.key value "
                f"(sections: {_valid_sections()})"
            )
        _check_key(section, key, "the command line")
        if not eq:
            native_section = "parallelism" if section == "distributed" else section
            native_key = (
                _DISTRIBUTED_KEYS[key] if section == "distributed" else _KEY_ALIASES.get((section, key), key)
            )
            is_bool = _split_optional(_HINTS[native_section][native_key])[0] is bool
            if i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            elif is_bool:
                value = "true"  # a bare boolean flag
            else:
                raise ConfigError(f"--{name} needs a value")
        raw.setdefault(section, {})[key] = value
    return path, raw


# ------------------------------------------------------------------------------------------- API


def load_config(argv: list[str] | None = None) -> Config:
    """Parse ``[--config PATH] [--section.key value | --section.key=value ...]`` into a Config.

    ``argv`` defaults to ``sys.argv[1:]``; every argument must be one of those forms (strip the
    trainer's own flags first).  Raises ConfigError for unknown sections/keys and bad values.
    """
    if argv is None:
        argv = sys.argv[1:]
    path, cli = _parse_cli(list(argv))
    cfg = Config()
    if path is not None:
        _apply(cfg, _normalize(_read_file(path), f"config file {path!r}"))
    # Later CLI occurrences win over earlier ones; aliases given on the CLI are checked against their
    # native spelling like in a file.
    _apply(cfg, _normalize(cli, "the command line"))
    cfg.validate()
    return cfg


def _fail(section: str, key: str, value: Any, requirement: str) -> None:
    raise ConfigError(f"{section}.{key}={value!r} is invalid: {requirement}")


def _validate(cfg: Config) -> None:
    for section, cls in _SECTIONS.items():
        obj = getattr(cfg, section)
        if not isinstance(obj, cls):
            raise ConfigError(f"section {section} must be a {cls.__name__}, got {type(obj).__name__}")
        for f in dataclasses.fields(cls):  # types (also for Configs built by hand)
            setattr(obj, f.name, _coerce(section, f.name, getattr(obj, f.name)))
    for (section, key), choices in _CHOICES.items():
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
    if m.name.lower() != "llama":
        _fail("model", "name", m.name, 'only "llama" is implemented')
    if not m.flavor:
        _fail("model", "flavor", m.flavor, "must not be empty")
    for key in ("vocab_size", "hidden_dim", "n_layers", "n_heads", "n_kv_heads"):
        v = getattr(m, key)
        if v is not None and v < 1:
            _fail("model", key, v, "must be >= 1 (or none for the flavor's)")
    if m.hidden_dim is not None and m.n_heads is not None and m.hidden_dim % m.n_heads:
        _fail("model", "hidden_dim", m.hidden_dim, f"must be divisible by model.n_heads={m.n_heads}")
    if m.n_heads is not None and m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        _fail("model", "n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")

    for key in ("steps", "batch_size", "seq_len"):
        if getattr(t, key) < 1:
            _fail("training", key, getattr(t, key), "must be >= 1")
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

    for key in ("dp_replicate", "tp", "pp"):
        if getattr(p, key) < 1:
            _fail("parallelism", key, getattr(p, key), "must be >= 1")
    if p.dp_shard != -1 and p.dp_shard < 1:
        _fail("parallelism", "dp_shard", p.dp_shard, "must be >= 1, or -1 for all remaining ranks")

    if not c.folder:
        _fail("checkpoint", "folder", c.folder, "must not be empty")
    for key in ("interval", "keep", "full_every", "zstd_level"):
        if getattr(c, key) < 1:
            _fail("checkpoint", key, getattr(c, key), "must be >= 1")
    if c.full_every > 1 and c.async_mode != "double_buffer":
        _fail("checkpoint", "full_every", c.full_every, "deltas need async_mode double_buffer")
    if c.keep_every is not None and c.keep_every < 1:
        _fail("checkpoint", "keep_every", c.keep_every, "must be >= 1 (or none)")
    if c.load_step is not None and c.load_step < 0:
        _fail("checkpoint", "load_step", c.load_step, "must be >= 0 (or none for the latest)")

    if cfg.metrics.log_freq < 1:
        _fail("metrics", "log_freq", cfg.metrics.log_freq, "must be >= 1")


def help_text() -> str:
    """Every ``--section.key`` with its type, default and help, plus the seed-style aliases."""
    lines = [
        "Configuration: --config PATH (.toml, or .yaml/.yml) and overrides --section.key VALUE",
        "(or --section.key=VALUE). Precedence: defaults < config file < command line.",
        "Booleans take true/false/1/0/yes/no (a bare --section.flag means true); optional fields take none.",
    ]
    for section, cls in _SECTIONS.items():
        lines += ["", f"[{section}]  {(cls.__doc__ or '').strip()}"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            if default is None:
                default_s = "none"
            elif isinstance(default, bool):
                default_s = str(default).lower()
            elif isinstance(default, str):
                default_s = repr(default)
            else:
                default_s = str(default)
            choices = _CHOICES.get((section, f.name))
            typ = "{" + ",".join(map(str, choices)) + "}" if choices else _type_name(_HINTS[section][f.name])
            lines.append(f"  --{section}.{f.name} {typ}  (default: {default_s})")
            lines.append(f"      {field_help(section, f.name)}")
    lines += ["", "Seed-style keys (accepted in files and on the command line):"]
    for (section, alias), key in _KEY_ALIASES.items():
        lines.append(f"  --{section}.{alias}  = --{section}.{key}")
    for alias, key in _DISTRIBUTED_KEYS.items():
        extra = " (with parallelism.dp_replicate = 1: the total data-parallel degree)" if alias == "dp_size" else ""
        lines.append(f"  --distributed.{alias}  = --parallelism.{key}{extra}")
    return "\n".join(lines)

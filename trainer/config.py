"""Trainer configuration: nested dataclasses, TOML/YAML files, ``--section.key value`` overrides.

The public entry: :class:`Config`, :func:`load_config`, :func:`help_text`, :class:`ConfigError`
and the section classes are imported from here. Precedence is defaults < config file < command
line. The pieces, each with its contract in its docstring:

* :mod:`trainer.config_schema`: the sections (keys, types, defaults, help text, allowed values);
* :mod:`trainer.config_fields`: coercion of raw values and the per-field help;
* :mod:`trainer.config_aliases`: the seed's YAML keys (``model.size``, ``training.max_steps``,
  ``distributed.tp_size/pp_size/dp_size``) mapped onto native fields;
* :mod:`trainer.config_parse`: files by extension, command-line arguments, ``--help``;
* :mod:`trainer.config_validate`: value ranges and choices.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from trainer.config_fields import field_help  # noqa: F401 - importable from here, as before
from trainer.config_parse import apply, help_text, normalize, parse_cli, read_file
from trainer.config_schema import (
    CheckpointConfig,
    ConfigError,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    OptimizationConfig,
    ParallelismConfig,
    TrainingConfig,
)
from trainer.config_validate import validate
from trainer.model import FLAVORS, ModelArgs, model_args

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
        apply(cfg, normalize(data, "dict"))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ConfigError naming the first key whose value is out of range."""
        validate(self)

    def model_args(self, tokenizer_vocab_size: int | None) -> ModelArgs:
        """The model's shapes: the flavor's, overridden by the explicit ``model.*`` values, the
        vocabulary the tokenizer's unless given, with room for ``training.seq_len`` positions.

        Raises ConfigError naming the keys when they cannot work: an unknown flavor, dimensions
        that do not divide, or ``model.vocab_size`` below ``tokenizer_vocab_size`` (None: not
        checked), whose token ids the embedding would not have.
        """
        m = self.model
        if m.flavor.lower() not in FLAVORS:
            raise ConfigError(f"model.flavor={m.flavor!r} is invalid: must be one of {', '.join(FLAVORS)}")
        if None not in (m.vocab_size, tokenizer_vocab_size) and m.vocab_size < tokenizer_vocab_size:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is invalid: the tokenizer has {tokenizer_vocab_size} "
                              "tokens, so it must be at least that (or none for the tokenizer's)")
        given = {key: getattr(m, key) for key in ("hidden_dim", "n_layers", "n_heads", "n_kv_heads")
                 if getattr(m, key) is not None}
        shape = {"dim" if key == "hidden_dim" else key: value for key, value in given.items()}
        try:
            return model_args(m.flavor, vocab_size=m.vocab_size or tokenizer_vocab_size, **shape,
                              max_seq_len=max(self.training.seq_len, FLAVORS[m.flavor.lower()].max_seq_len))
        except ValueError as e:
            named = "".join(f", model.{key}={value}" for key, value in given.items())
            raise ConfigError(f"model.flavor={m.flavor!r}{named} cannot work: {e}") from None

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


def load_config(argv: list[str] | None = None) -> Config:
    """Parse ``[--config PATH] [--section.key value | --section.key=value ...]`` into a Config.

    ``argv`` defaults to ``sys.argv[1:]``; every argument must be one of those forms (strip the
    trainer's own flags first).  Raises ConfigError for unknown sections/keys and bad values.
    """
    if argv is None:
        argv = sys.argv[1:]
    path, cli = parse_cli(list(argv))
    cfg = Config()
    if path is not None:
        apply(cfg, normalize(read_file(path), f"config file {path!r}"))
    # Later CLI occurrences win over earlier ones; aliases given on the CLI are checked against their
    # native spelling like in a file.
    apply(cfg, normalize(cli, "the command line"))
    cfg.validate()
    return cfg

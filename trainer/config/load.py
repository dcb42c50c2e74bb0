"""The whole configuration (:class:`Config`) and where it comes from (:func:`load_config`).

Contract: precedence is defaults < config file < command line; the result is validated
(:mod:`trainer.config.validate`), so every :class:`Config` this returns can be used. Its
:meth:`Config.model_args` and :meth:`Config.resolve_batch` are :mod:`trainer.config.derive`'s.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from . import derive
from .parse import apply, normalize, parse_cli, read_file
from .schema import (
    CheckpointConfig,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    OptimizationConfig,
    ParallelismConfig,
    TrainingConfig,
)
from .validate import validate
from ..model import ModelArgs


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
        """The model's shapes (:func:`trainer.config.derive.model_args`): the flavor's, overridden
        by the explicit ``model.*`` values, the vocabulary the tokenizer's unless given;
        ConfigError naming the keys when they cannot work."""
        return derive.model_args(self, tokenizer_vocab_size)

    def resolve_batch(self, dp_degree: int) -> tuple[int, int]:
        """(micro_batch_size, gradient_accumulation_steps) for a data-parallel degree
        (:func:`trainer.config.derive.resolve_batch`); ConfigError with the arithmetic spelled out."""
        return derive.resolve_batch(self, dp_degree)


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

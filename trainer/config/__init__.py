"""Trainer configuration: nested dataclasses, TOML/YAML files, ``--section.key value`` overrides.

The public entry: :class:`Config`, :func:`load_config`, :func:`help_text`, :class:`ConfigError`
and the section classes are imported from here. Precedence is defaults < config file < command
line. The pieces, each with its contract in its docstring (each imports only those listed before it):

* :mod:`trainer.config.checkpoint`: the ``checkpoint`` section, its engine options taken from
  :class:`ckpt.options.SaveOptions` (named once);
* :mod:`trainer.config.schema`: the sections (keys, types, defaults, help text, allowed values);
* :mod:`trainer.config.fields`: coercion of raw values and the per-field help;
* :mod:`trainer.config.aliases`: the seed's YAML keys (``model.size``, ``training.max_steps``,
  ``distributed.tp_size/pp_size/dp_size``) mapped onto native fields;
* :mod:`trainer.config.parse`: files by extension, command-line arguments, ``--help``;
* :mod:`trainer.config.derive`: the model's shapes and the batch split a configuration implies;
* :mod:`trainer.config.validate`: value ranges and choices;
* :mod:`trainer.config.load`: :class:`Config` and :func:`load_config`.
* :mod:`trainer.config.reference`: docs/CONFIG.md, the key reference, from the pieces ``--help`` prints
  (``python -m trainer.config > docs/CONFIG.md``).
"""

from __future__ import annotations

from .fields import field_help
from .load import Config, load_config
from .parse import help_text
from .schema import (
    CheckpointConfig,
    ConfigError,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    OptimizationConfig,
    ParallelismConfig,
    TrainingConfig,
)

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
    "field_help",
    "help_text",
    "load_config",
]

"""The seed's YAML keys, accepted as aliases of native fields in files and on the command line.

==============================  =======================================================
seed key                        native field
==============================  =======================================================
``model.size``                  ``model.flavor``
``training.max_steps``          ``training.steps``
``distributed.tp_size``         ``parallelism.tp``
``distributed.pp_size``         ``parallelism.pp``
``distributed.dp_size``         ``parallelism.dp_shard`` (and ``parallelism.dp_replicate = 1``)
==============================  =======================================================

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
DISTRIBUTED_KEYS: dict[str, str] = {"tp_size": "tp", "pp_size": "pp", "dp_size": "dp_shard"}

SEED_SECTION_NOTE = f"{SEED_SECTION} (seed style: {', '.join(DISTRIBUTED_KEYS)})"
"""How the seed section is listed among the valid sections."""


def is_alias(section: str, key: str) -> bool:
    """Whether ``section.key`` is a seed-style spelling."""
    return (section == SEED_SECTION and key in DISTRIBUTED_KEYS) or (section, key) in KEY_ALIASES


def native(section: str, key: str) -> tuple[str, str]:
    """The native (section, key) that ``section.key`` sets (itself unless it is an alias)."""
    if section == SEED_SECTION:
        return "parallelism", DISTRIBUTED_KEYS[key]
    return section, KEY_ALIASES.get((section, key), key)


def valid_aliases(section: str) -> list[str]:
    """The seed-style keys of ``section``, as listed in unknown-key errors."""
    if section == SEED_SECTION:
        return list(DISTRIBUTED_KEYS)
    return [f"{a} (= {k})" for (s, a), k in KEY_ALIASES.items() if s == section]


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
    return lines

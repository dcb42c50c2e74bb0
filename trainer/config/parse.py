"""Configuration sources: files by extension, ``--section.key value`` arguments, and ``--help``.

Contract: :func:`read_file` loads ``.toml`` (tomllib/tomli) or ``.yaml``/``.yml`` (yaml.safe_load);
:func:`parse_cli` splits ``[--config PATH] [--section.key value | --section.key=value ...]`` (a bare
boolean flag means true); :func:`normalize` turns one source's ``{section: {key: value}}`` into
coerced native values (unknown sections/keys are errors listing the valid ones; seed aliases are
mapped and must agree with their native keys) and :func:`apply` sets them on a Config. Every error
is a :class:`ConfigError` with one readable message.

No CLI library (tyro 1.0.17 evaluated): it would replace only :func:`parse_cli`, while files,
coercion of file values and alias checks stay here. It breaks: bools are ``--flag/--no-flag`` or
``--flag True|False`` (not both, no 0/no/yes); ``None`` but not ``none``; aliases need tyro in the
schema's annotations, the last spelling wins (no agreement check), no rule for dp_size;
errors are SystemExit(2) with boxed stderr ("Perhaps you meant", not the valid keys); ``--help``
has its own format. Wrapping all that would cost more code than the ~45 lines it replaces.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from . import aliases
from .fields import HINTS, coerce, help_lines, is_bool
from .schema import SECTIONS, ConfigError


def _valid_sections() -> str:
    return ", ".join(list(SECTIONS) + [aliases.SEED_SECTION_NOTE])


def _check_section(section: Any, where: str) -> None:
    if section not in SECTIONS and section != aliases.SEED_SECTION:
        raise ConfigError(f"unknown section {section!r} in {where}; valid sections: {_valid_sections()}")


def _check_key(section: str, key: str, where: str) -> None:
    _check_section(section, where)
    if (section in SECTIONS and key in HINTS[section]) or aliases.is_alias(section, key):
        return
    native = [f.name for f in dataclasses.fields(SECTIONS[section])] if section in SECTIONS else []
    valid = ", ".join(native + aliases.valid_aliases(section))
    raise ConfigError(f"unknown key {section}.{key} in {where}; valid keys of [{section}]: {valid}")


def normalize(data: Any, where: str) -> dict[str, dict[str, Any]]:
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
            value = coerce(section, key, raw)
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
        _check_section(section, where)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: section [{section}] must be a mapping of keys, got {body!r}")
        for key, raw in body.items():
            key = str(key)
            _check_key(section, key, where)
            if (section, key) == (aliases.SEED_SECTION, "dp_size"):
                dp_size = aliases.dp_size(raw, where)
            else:
                put(*aliases.native(section, key), f"{section}.{key}", raw)
    if dp_size is not None:
        aliases.merge_dp_size(out.setdefault("parallelism", {}), dp_size, where)
    return out


def apply(cfg: Any, values: dict[str, dict[str, Any]]) -> None:
    """Set ``normalize``'s values on the Config ``cfg``."""
    for section, body in values.items():
        obj = getattr(cfg, section)
        for key, value in body.items():
            setattr(obj, key, value)


def read_file(path: str) -> Any:
    """The parsed content of a .toml, .yaml or .yml file."""
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


def parse_cli(argv: list[str]) -> tuple[str | None, dict[str, dict[str, Any]]]:
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
            if i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            elif is_bool(*aliases.native(section, key)):
                value = "true"  # a bare boolean flag
            else:
                raise ConfigError(f"--{name} needs a value")
        raw.setdefault(section, {})[key] = value
    return path, raw


def help_text() -> str:
    """Every ``--section.key`` with its type, default and help, plus the seed-style aliases."""
    lines = [
        "Configuration: --config PATH (.toml, or .yaml/.yml) and overrides --section.key VALUE",
        "(or --section.key=VALUE). Precedence: defaults < config file < command line.",
        "Booleans take true/false/1/0/yes/no (a bare --section.flag means true); optional fields take none.",
        "",
        "--dry-run  print the plan of this config instead of training: layout, memory per rank, checkpoint",
        "           sizes and times, whether it fits (no process group, nothing allocated; docs/DRY_RUN.md).",
        "           With --world-size N, --device-memory GIB|NAME, --storage-gbps X, --json (python -m trainer.plan --help).",
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"[{section}]  {(cls.__doc__ or '').strip()}"]
        lines += help_lines(section)
    return "\n".join(lines + [""] + aliases.help_lines())

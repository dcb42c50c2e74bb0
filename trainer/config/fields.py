"""What each configuration field accepts and how it is documented.

Contract: :func:`coerce` turns a raw value from a file or the command line (or one set by hand)
into the annotated type of ``section.key`` (``X | None`` fields take ``none``/``null``; booleans
take true/false/1/0/yes/no/y/n/on/off) or raises :class:`ConfigError` naming the key.
:func:`field_help`, :func:`field_docs` and :func:`help_lines` give the field's help (its ``help`` metadata, else its
attribute docstring, parsed with :mod:`ast` from the source of the module defining the section
class or the base class that declares it, at import time), type and default.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import sys
import types
import typing
from typing import Any

from .schema import CHOICES, SECTIONS, ConfigError

HINTS: dict[str, dict[str, Any]] = {name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()}

_TRUE = {"true", "1", "yes", "y", "on"}
_FALSE = {"false", "0", "no", "n", "off"}


def split_optional(tp: Any) -> tuple[Any, bool]:
    """(base type, optional?) for ``X`` or ``X | None``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:  # pragma: no cover - not used by the sections
            raise TypeError(f"unsupported annotation {tp!r}")
        return args[0], True
    return tp, False


def is_bool(section: str, key: str) -> bool:
    """Whether section.key is a (possibly optional) boolean, i.e. may be given as a bare flag."""
    return split_optional(HINTS[section][key])[0] is bool


def coerce(section: str, key: str, value: Any) -> Any:
    """Convert ``value`` (from a file or the command line) to the annotated type of section.key."""
    base, optional = split_optional(HINTS[section][key])
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
    if typing.get_origin(base) is list:  # a YAML/TOML list, or comma-separated on the command line
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)) and all(isinstance(item, str) for item in items):
            return [item.strip() for item in items if item.strip()]
        raise ConfigError(f"{name} expects a list of strings (or one comma-separated string), got {value!r}")
    raise TypeError(f"unsupported annotation for {name}: {base!r}")  # pragma: no cover


# ---------------------------------------------------------------------------------- field docs


def _class_docs(cls: type) -> dict[str, str]:
    """{field: attribute docstring} of the fields ``cls`` itself declares, from its module's source."""
    try:
        with open(sys.modules[cls.__module__].__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, TypeError, KeyError, AttributeError):  # pragma: no cover - no sources
        return {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return {
                stmt.target.id: " ".join(nxt.value.value.split())
                for stmt, nxt in zip(node.body, node.body[1:])
                if isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            }
    return {}


def _parse_field_docs() -> dict[str, dict[str, str]]:
    """{section: {field: help}}: a field's ``help`` metadata, else its attribute docstring in the
    nearest class of the section's MRO that has one."""
    docs: dict[str, dict[str, str]] = {}
    for section, cls in SECTIONS.items():
        per: dict[str, str] = {}
        for klass in reversed(cls.__mro__[:-1]):  # bases first, so a subclass's docstring wins
            per.update(_class_docs(klass))
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                per[f.name] = " ".join(f.metadata["help"].split())
        docs[section] = per
    return docs


_FIELD_DOCS = _parse_field_docs()


def field_help(section: str, key: str) -> str:
    """The help text of ``section.key`` (its attribute docstring or ``help`` metadata)."""
    return _FIELD_DOCS.get(section, {}).get(key, "")


def _default_text(f: dataclasses.Field) -> str:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if default is None:
        return "none"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, str):
        return repr(default)
    return str(default)


def _type_text(section: str, key: str) -> str:
    choices = CHOICES.get((section, key))
    if choices:
        return "{" + ",".join(map(str, choices)) + "}"
    base, optional = split_optional(HINTS[section][key])
    return base.__name__ + ("|none" if optional else "")


class FieldDoc(typing.NamedTuple):
    """One field as ``--help`` and docs/CONFIG.md show it."""

    flag: str  # --section.key
    type: str  # int, str|none, {a,b,c}
    default: str  # as the value would be written: 'text', 3, none, true
    help: str


def field_docs(section: str) -> list[FieldDoc]:
    """Every field of ``section``, in declaration order, as :class:`FieldDoc`."""
    return [FieldDoc(f"--{section}.{f.name}", _type_text(section, f.name), _default_text(f), field_help(section, f.name))
            for f in dataclasses.fields(SECTIONS[section])]


def help_lines(section: str) -> list[str]:
    """Two lines per field of ``section``: ``--section.key TYPE  (default: X)`` and its help."""
    lines = []
    for doc in field_docs(section):
        lines.append(f"  {doc.flag} {doc.type}  (default: {doc.default})")
        lines.append(f"      {doc.help}")
    return lines

"""What ``ckpt-inspect STEP`` shows of one checkpoint beyond its tensor table: each plain value
previewed, the run config its trainer recorded, and the sizes per prefix.

Contract: everything is read from the manifest alone (no data file is opened, no value decoded:
a preview is built from the stored tagged JSON, so an RNG state of 5 kB or a hostile value of
megabytes costs a bounded walk). :func:`preview` is one line of at most :data:`PREVIEW_CHARS`
characters: small scalars and strings inline, a container or array by its type and size, short
flat containers inline; a ``torch_save`` value by its stored size (never unpickled).
:func:`run_config` is the trainer's config record (manifest user metadata ``config``) or, for an
import, the recorded model arguments (``model_args``); :func:`prefix_sizes` sums tensors,
elements and bytes per first key component (``model``, ``optimizer``, ``lr_scheduler`` ...).
"""

from __future__ import annotations

import math
from typing import Any

from ..format import Manifest, ValueEntry

PREVIEW_CHARS = 120
INLINE_ITEMS = 8  # a flat container of at most this many scalars is shown whole
TAG = "__ckpt__"


def _scalar(value: Any) -> str | None:
    """A JSON scalar (or a tagged float/dtype) as text; None for anything else."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...") + ("" if len(value) <= 60 else
                                                                         f" ({len(value)} chars)")
    if isinstance(value, dict) and value.get(TAG) == "float":
        return str(value.get("value"))
    if isinstance(value, dict) and value.get(TAG) == "torch.dtype":
        return f"torch.{value.get('name')}"
    return None


def _clip(text: str) -> str:
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS - 3] + "..."


def _sequence(items: list, kind: str, brackets: str) -> str:
    shown = [_scalar(item) for item in items[:INLINE_ITEMS + 1]]
    if len(items) <= INLINE_ITEMS and all(s is not None for s in shown):
        return brackets[0] + ", ".join(shown) + ("," if kind == "tuple" and len(items) == 1 else "") + brackets[1]
    return f"{kind} of {len(items)} items"


def _mapping(pairs: list, kind: str) -> str:
    if len(pairs) <= INLINE_ITEMS:
        parts = [(_scalar(k), _scalar(v)) for k, v in pairs]
        if all(k is not None and v is not None for k, v in parts):
            return "{" + ", ".join(f"{k}: {v}" for k, v in parts) + "}"
    keys = ", ".join(str(k)[:20].encode("utf-8", "backslashreplace").decode() for k, _ in pairs[:4]
                     if isinstance(k, (str, int)))
    return f"{kind} of {len(pairs)} keys" + (f" ({keys}{', ...' if len(pairs) > 4 else ''})" if keys else "")


def preview(entry: ValueEntry) -> str:
    """One bounded line describing a stored value (see the module docstring)."""
    if entry.encoding != "json":
        size = entry.blob.decoded_length if entry.blob is not None else None
        return f"torch.save stream, {size} bytes (not read)" if size is not None else "torch.save stream"
    value = entry.value
    text = _scalar(value)
    if text is not None:
        return _clip(text)
    if isinstance(value, list):
        return _clip(_sequence(value, "list", "[]"))
    if not isinstance(value, dict):
        return type(value).__name__
    tag = value.get(TAG)
    if tag is None:
        return _clip(_mapping(list(value.items()), "dict"))
    items = value.get("items")
    if tag == "tuple" and isinstance(items, list):
        return _clip(_sequence(items, "tuple", "()"))
    if tag == "dict" and isinstance(items, list):
        return _clip(_mapping([tuple(p) if isinstance(p, list) and len(p) == 2 else (None, None) for p in items],
                              "dict"))
    if tag == "bytes":
        encoded = value.get("base64")
        return f"bytes, {len(encoded) * 3 // 4 if isinstance(encoded, str) else '?'} bytes"
    if tag == "ndarray":
        shape = value.get("shape")
        shape = "x".join(map(str, shape)) if isinstance(shape, list) and len(shape) <= 8 else "?"
        return _clip(f"ndarray {value.get('dtype')} [{shape}]")
    return _clip(f"tagged {str(tag)[:40]}")


def run_config(manifest: Manifest) -> dict | None:
    """``{"config": <the run's config record>}`` and/or ``{"model_args": ...}`` as the manifest's
    user metadata records them; None when it records neither (a plain DCP import, a foreign save)."""
    user = manifest.user if isinstance(manifest.user, dict) else {}
    found = {key: user[key] for key in ("config", "model_args") if isinstance(user.get(key), dict)}
    return found or None


def config_lines(config: dict, limit: int = 80) -> list[str]:
    """``section.key = value`` lines of a config record (nested one level; at most ``limit``; unset
    keys, null in the record, counted in one last line)."""
    lines, unset = [], 0
    for section, body in config.items():
        for key, value in (body.items() if isinstance(body, dict) else [(None, body)]):
            if value is None:
                unset += 1
                continue
            name = (section if key is None else f"{section}.{key}").encode("utf-8", "backslashreplace").decode()
            lines.append(f"{name} = {_scalar(value) or _clip(repr(value))}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines + ([f"({unset} keys unset: their defaults)"] if unset else [])


def prefix_of(key: str) -> str:
    return key.split(".", 1)[0]


def prefix_sizes(manifest: Manifest) -> dict[str, dict]:
    """Per first key component: tensors, elements (parameters, for the model), raw and stored bytes,
    and the plain values under it."""
    sizes: dict[str, dict] = {}

    def row(prefix: str) -> dict:
        return sizes.setdefault(prefix, {"tensors": 0, "elements": 0, "raw_bytes": 0, "stored_bytes": 0,
                                         "values": 0})

    for key, entry in manifest.tensors.items():
        item = row(prefix_of(key))
        item["tensors"] += 1
        item["elements"] += math.prod(entry.shape)
        item["raw_bytes"] += sum(c.blob.decoded_length for c in entry.chunks)
        item["stored_bytes"] += sum(c.blob.length for c in entry.chunks)
    for key in manifest.values:
        row(prefix_of(key))["values"] += 1
    return dict(sorted(sizes.items()))

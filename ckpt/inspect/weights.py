"""``ckpt-inspect`` on weights that are not a checkpoint of ours: one ``.safetensors`` file, or a
Hugging Face model directory (``config.json`` + ``model.safetensors`` or shards and their index).

Contract: only headers are read (never a tensor's bytes, never a pickle: ``pytorch_model*.bin``
files are listed by name and size only), and every header is hostile input, bounded before use:
a safetensors header of at most :data:`MAX_HEADER_BYTES` that fits inside its file, JSON nested at
most :data:`MAX_DEPTH` levels, at most :data:`MAX_TENSORS` entries, each with a known dtype, a
shape of at most 64 non-negative dimensions and ``data_offsets`` that lie inside the data and span
exactly the shape's bytes; ``__metadata__`` strings only (shown clipped). A JSON file of the
directory (config.json, the index) is at most :data:`MAX_JSON_BYTES`, its ``weight_map`` names only
plain file names inside the directory. What fails raises :class:`~ckpt.errors.InvalidManifestError`
naming the file. :func:`safetensors_summary` and :func:`hf_summary` return JSON-ready dicts.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, InvalidManifestError

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
MAX_JSON_BYTES = 16 << 20
MAX_DEPTH = 32
MAX_TENSORS = 1 << 20
MAX_DIMS = 64
SHOWN_METADATA_CHARS = 200
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def is_weights_file(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".safetensors") and Path(path).is_file()


def is_hf_directory(path: str | os.PathLike) -> bool:
    folder = Path(path)
    return folder.is_dir() and (folder / "config.json").is_file() and not (folder / "manifest.json").exists() and \
        (any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json")) or
         any(folder.glob("pytorch_model*.bin")))


def _bad(file: Path, text: str) -> InvalidManifestError:
    return InvalidManifestError(f"{file}: {text}", path=str(file.parent), file=file.name)


def _json(data: bytes, file: Path, what: str) -> Any:
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise _bad(file, f"{what} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(file, f"{what} is not valid JSON ({' '.join(str(exc).split())[:120]})") from None
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _bad(file, f"{what} nests more than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return value


def read_json_file(file: Path, what: str) -> Any:
    if file.is_symlink() and not file.resolve().is_file():
        raise _bad(file, "is a broken symbolic link")
    size = file.stat().st_size
    if size > MAX_JSON_BYTES:
        raise _bad(file, f"is {size} bytes; {what} is never above {MAX_JSON_BYTES}")
    with open(file, "rb") as f:
        return _json(f.read(MAX_JSON_BYTES + 1), file, what)


def _clip(text: str) -> str:
    """At most :data:`SHOWN_METADATA_CHARS` characters, any lone surrogate escaped (printable)."""
    text = text if len(text) <= SHOWN_METADATA_CHARS else text[:SHOWN_METADATA_CHARS - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _unicode(file: Path, name: str) -> str:
    """A tensor name as it is, refused when it is not valid Unicode (a lone surrogate from a JSON
    escape, which no tool could print)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(file, f"its header names the tensor {ascii(name)[:80]}, which is not valid Unicode") from None
    return name


def safetensors_header(file: Path) -> tuple[dict[str, dict], dict[str, str], int]:
    """``(tensors, metadata, file size)`` of a .safetensors file: each tensor's dtype, shape,
    bytes and offset (checked, see the module docstring), the ``__metadata__`` strings (clipped)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(file, f"is {size} bytes: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise _bad(file, f"declares a {length}-byte header in a {size}-byte file (at most "
                             f"{min(MAX_HEADER_BYTES, size - 8)}): not a safetensors file")
        header = _json(f.read(length), file, "its safetensors header")
    if not isinstance(header, dict):
        raise _bad(file, "its safetensors header is not a JSON object")
    if len(header) > MAX_TENSORS + 1:
        raise _bad(file, f"its header names {len(header)} entries (at most {MAX_TENSORS})")
    data_bytes = size - 8 - length
    raw_metadata = header.pop("__metadata__", None) or {}
    if not isinstance(raw_metadata, dict) or not all(isinstance(v, str) for v in raw_metadata.values()):
        raise _bad(file, "its __metadata__ is not an object of strings")
    metadata = {_clip(str(k)): _clip(v) for k, v in list(raw_metadata.items())[:64]}
    tensors = {}
    for name, entry in header.items():
        shown = ascii(_unicode(file, name))[:80]
        if not isinstance(entry, dict):
            raise _bad(file, f"header entry {shown} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise _bad(file, f"{shown} has dtype {ascii(dtype)[:40]}, not one safetensors defines")
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and
                all(type(d) is int and 0 <= d < 2**62 for d in shape)):
            raise _bad(file, f"{shown} has shape {ascii(shape)[:80]}: not a list of at most {MAX_DIMS} sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets) and
                0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise _bad(file, f"{shown} has data_offsets {ascii(offsets)[:80]} outside the file's "
                             f"{data_bytes} data bytes")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise _bad(file, f"{shown}: data_offsets span {offsets[1] - offsets[0]} bytes; its shape needs {nbytes}")
        tensors[name] = {"dtype": dtype, "shape": shape, "bytes": nbytes, "offset": offsets[0]}
    return dict(sorted(tensors.items())), metadata, size


def safetensors_summary(path: str | os.PathLike) -> dict:
    file = Path(path)
    tensors, metadata, size = safetensors_header(file)
    return {"path": str(file), "format": "safetensors", "file_bytes": size, "metadata": metadata,
            "totals": _totals(tensors), "tensors": tensors}


def _totals(tensors: dict[str, dict]) -> dict:
    return {"tensors": len(tensors), "elements": sum(math.prod(t["shape"]) for t in tensors.values()),
            "bytes": sum(t["bytes"] for t in tensors.values()),
            "dtypes": sorted({t["dtype"] for t in tensors.values()})}


CONFIG_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings", "torch_dtype",
               "dtype", "tie_word_embeddings", "rope_theta", "transformers_version")


def _weight_files(folder: Path) -> list[Path]:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if not indexes:
        return sorted(folder.glob("*.safetensors"))
    index = read_json_file(indexes[0], "a safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or len(weight_map) > MAX_TENSORS:
        raise _bad(indexes[0], f"has no weight_map object of at most {MAX_TENSORS} entries")
    names = set()
    for name in weight_map.values():
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or \
                "\x00" in name or len(name) > 255:
            raise _bad(indexes[0], f"weight_map names {ascii(name)[:80]}, not a file inside the directory")
        names.add(name)
    missing = sorted(n for n in names if not (folder / n).is_file())
    if missing:
        raise CheckpointNotFoundError(f"{folder}: {missing[0]} (named by {indexes[0].name}) is missing",
                                      path=str(folder))
    return [folder / n for n in sorted(names)]


def _shown(value: Any) -> Any:
    """A config value as shown: a scalar as it is, anything else (or a long string) clipped JSON text."""
    if value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 80):
        return value
    return _clip(json.dumps(value) if not isinstance(value, str) else value)


def hf_summary(path: str | os.PathLike) -> dict:
    """A Hugging Face model directory: the config's main keys, every safetensors file's tensors
    (headers only), the torch ``.bin`` files by size (not read), the other files by size."""
    folder = Path(path)
    config = read_json_file(folder / "config.json", "config.json")
    if not isinstance(config, dict):
        raise _bad(folder / "config.json", "does not hold a JSON object")
    tensors, files = {}, {}
    for file in _weight_files(folder):
        found, _metadata, size = safetensors_header(file)
        files[file.name] = size
        for name, entry in found.items():
            tensors[name] = {**entry, "file": file.name}
    others = {p.name: p.stat().st_size for p in sorted(folder.iterdir())[:1000]
              if p.is_file() and p.name not in files}
    shown = {k: _shown(config[k]) for k in CONFIG_KEYS if k in config}
    return {"path": str(folder), "format": "hf", "config": shown,
            "weights_files": files, "other_files": others, "unread": sorted(n for n in others if n.endswith(".bin")),
            "totals": _totals(tensors), "tensors": dict(sorted(tensors.items()))}

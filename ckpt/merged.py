"""Merged save: the whole state as one consolidated ``.safetensors`` file.

The header (names, dtypes, global shapes, offsets) is known from metadata alone, so it is written
first and each tensor is then gathered (``DTensor.full_tensor``) and streamed to the file one at a
time: peak extra memory is one full tensor, never the whole model. Rank 0 writes; every rank joins
each gather. Keys are the flattened DCP keys of the sharded format (``model.layers.0.attention.wq.weight``);
non-tensor values travel in the header's ``__metadata__`` as tagged JSON under ``ckpt.values``.
The file appears atomically (tmp name, fsync, rename, fsync parent).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from . import values
from .datafile import tensor_bytes
from .errors import CheckpointExistsError, CheckpointWriteError, UnsupportedFormatError
from .fileio import fsync_dir, write_all
from .state import export_state

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def save_merged(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    user_metadata: dict | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
) -> None:
    path = Path(path)
    distributed = not no_dist and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    flat, paths = flatten_state_dict(export_state(state)[0])
    names = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor))
    header = _header(flat, names, paths, user_metadata or {})

    failure: str | None = None
    fd = tmp = None
    if rank == 0:
        try:
            if path.exists() and not overwrite:
                raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            write_all(fd, memoryview(header))
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
    for name in names:  # every rank joins every gather, even after rank 0 failed, to stay in step
        tensor = flat[name]
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0 and failure is None:
            try:
                write_all(fd, memoryview(tensor_bytes(full)))
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
        del full
    if rank == 0:
        try:
            if failure is None:
                os.fsync(fd)
                os.close(fd)
                fd = None
                os.replace(tmp, path)
                fsync_dir(path.parent)
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            if fd is not None:
                os.close(fd)
            if failure is not None and tmp is not None and tmp.exists():
                tmp.unlink()
    if distributed:
        box = [failure]
        dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                                   group=process_group)
        failure = box[0]
    if failure is not None:
        if failure.startswith("CheckpointExistsError"):
            raise CheckpointExistsError(failure.split(": ", 1)[1])
        raise CheckpointWriteError(f"merged save to {path} failed: {failure}")


def _header(flat: dict, names: list[str], paths: dict, user_metadata: dict) -> bytes:
    entries: dict[str, Any] = {}
    offset = 0
    for name in names:
        tensor = flat[name]
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise UnsupportedFormatError(f"{name}: dtype {tensor.dtype} has no safetensors code")
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    plain = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    entries["__metadata__"] = {
        "format": "pt",
        "ckpt.values": json.dumps(values.encode(plain)),
        "ckpt.paths": json.dumps({k: list(p) for k, p in paths.items()}),
        "ckpt.user": json.dumps(user_metadata),
    }
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return len(raw).to_bytes(8, "little") + raw

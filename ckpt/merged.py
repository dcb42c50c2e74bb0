"""Merged save: the whole state as one consolidated ``.safetensors`` file.

The header (names, dtypes, global shapes, offsets) is known from metadata alone, so it is written
first and each tensor is then gathered (``DTensor.full_tensor``) and streamed to the file one at a
time: peak extra memory is one full tensor, never the whole model. Rank 0 writes; every rank joins
each gather. Keys are the flattened DCP keys of the sharded format (``model.layers.0.attention.wq.weight``);
non-tensor values travel in the header's ``__metadata__`` as tagged JSON under ``ckpt.values``.
The file appears atomically (:class:`ckpt.commit.PendingFile`); a failure on rank 0 is raised on
every rank as the same error.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from .format import values
from .collective import broadcast_error
from .commit import PendingFile
from .errors import CheckpointError, CheckpointWriteError, UnsupportedFormatError
from .state import export_state
from .storage import locate
from .write import tensor_bytes

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
    storage_options: dict | None = None,
) -> None:
    path = locate(path, storage_options)
    distributed = not no_dist and dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    flat, paths = flatten_state_dict(export_state(state)[0])
    names = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor))
    header = _header(flat, names, paths, user_metadata or {})

    failure: CheckpointError | None = None
    pending: PendingFile | None = None

    def attempt(fn) -> None:
        nonlocal failure
        if failure is None:
            try:
                fn()
            except CheckpointError as exc:
                failure = exc
            except Exception as exc:
                failure = CheckpointWriteError(f"merged save to {path} failed: {type(exc).__name__}: {exc}")

    if rank == 0:
        def start() -> None:
            nonlocal pending
            pending = PendingFile(path, overwrite=overwrite)
            pending.write(header)

        attempt(start)
    for name in names:  # every rank joins every gather, even after rank 0 failed, to stay in step
        tensor = flat[name]
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank == 0:
            attempt(lambda full=full: pending.write(tensor_bytes(full)))
        del full
    if rank == 0:
        attempt(lambda: pending.publish())
        if failure is not None and pending is not None:
            pending.abort()
    failure = broadcast_error(failure, process_group, distributed=distributed)
    if failure is not None:
        raise failure


def _header(flat: dict, names: list[str], paths: dict, user_metadata: dict) -> bytes:
    plain = {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    try:
        encoded = json.dumps(values.encode(plain))
    except values.NotJSONable as exc:  # the header is text: nothing else fits there
        raise UnsupportedFormatError(f"a merged .safetensors file holds plain values as JSON only: {exc}") from None
    metadata = {
        "format": "pt",
        "ckpt.values": encoded,
        "ckpt.paths": json.dumps({k: list(p) for k, p in paths.items()}),
        "ckpt.user": json.dumps(user_metadata),
    }
    return safetensors_header(((name, flat[name].dtype, flat[name].shape) for name in names), metadata)


def safetensors_header(tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]], metadata: dict[str, str]) -> bytes:
    """The header of a ``.safetensors`` file whose data section holds ``tensors`` (name, dtype,
    shape) back to back in the order given: the 8-byte little-endian length, then the JSON (padded
    with spaces to a multiple of 8 bytes, as safetensors aligns its data section). Built from
    metadata alone, so a writer can put it first and stream the tensors after it (this module and
    :mod:`ckpt.consolidate`)."""
    entries: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in SAFETENSORS_DTYPES:
            raise UnsupportedFormatError(f"{name}: dtype {dtype} has no safetensors code")
        if name in entries or name == "__metadata__":
            raise UnsupportedFormatError(f"{name!r} cannot be a safetensors tensor name here (repeated or reserved)")
        numel = 1
        for size in shape:
            numel *= int(size)
        nbytes = numel * dtype.itemsize
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": [int(size) for size in shape],
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return len(raw).to_bytes(8, "little") + raw

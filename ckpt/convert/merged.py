"""Merged save: the whole state as one consolidated ``.safetensors`` file.

The header (names, dtypes, global shapes, offsets) is known from metadata alone, so it is written
first and each tensor is then gathered (``DTensor.full_tensor``) and streamed to the file one at a
time: peak extra memory is one full tensor, never the whole model. Rank 0 writes; every rank joins
each gather. Keys are the flattened DCP keys of the sharded format (``model.layers.0.attention.wq.weight``);
non-tensor values travel in the header's ``__metadata__`` as tagged JSON under ``ckpt.values``.
The header is :func:`ckpt.convert.formats.safetensors_header`. The file appears atomically
(:class:`ckpt.commit.PendingFile`); a failure on rank 0 is raised on every rank as the same error.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from ..collective import broadcast_error
from ..commit import PendingFile
from ..errors import CheckpointError, CheckpointWriteError, UnsupportedFormatError
from ..format import values
from ..state import export_state
from ..storage import locate
from ..write.files import tensor_bytes
from .formats import safetensors_header


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

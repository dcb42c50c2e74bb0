"""Consolidation: a committed checkpoint's tensors, whole, one at a time — the reading half of
every export (``ckpt-merge``, ``ckpt-convert``; written out by :mod:`ckpt.convert.export`).

1. choose   :func:`select_keys` picks tensor keys (all, ``model``, ``optim`` or any key prefix) and
            :func:`tensor_specs` describes them (key, dtype, global shape) from the manifest alone;
2. read     :func:`full_tensors` assembles one tensor at a time from its chunks through
            :class:`ckpt.read.source.ChunkSource` (so every chunk is verified, deltas are replayed through
            their chain and every mount works): the global shape is allocated once
            (:func:`empty_tensor`) and each decoded chunk is copied into its slice (a raw chunk is
            read straight into it).

Peak memory is one full tensor plus one chunk, whatever the size of the checkpoint.
"""

from __future__ import annotations

import mmap
import os
from typing import Iterable, Iterator

import torch

from ..read.committed import read_manifest
from ..errors import CheckpointError
from ..format import Manifest
from ..read.source import ChunkSource
from ..storage import Location, locate
from .formats import TensorSpec

GROUPS = {"model": "model.", "optim": "optim."}


# -- 1. choose ---------------------------------------------------------------------------------
def select_keys(manifest: Manifest, only: str | None) -> list[str]:
    """The checkpoint's tensor keys, sorted, that ``only`` selects: None all of them, ``"model"``
    / ``"optim"`` those under ``model.`` / ``optim.``, anything else a key prefix
    (``"model.layers.0."``). A selection matching no tensor raises :class:`CheckpointError`."""
    keys = sorted(manifest.tensors)
    if only is None:
        if not keys:
            raise CheckpointError("the checkpoint holds no tensors")
        return keys
    prefix = GROUPS.get(only, only)
    chosen = [key for key in keys if key.startswith(prefix)]
    if not chosen:
        tops = sorted({key.split(".", 1)[0] for key in keys})
        raise CheckpointError(f"no tensor key starts with {prefix!r} (top-level names here: "
                              f"{', '.join(tops) or 'none'})")
    return chosen


def tensor_specs(manifest: Manifest, keys: Iterable[str] | None = None, *,
                 dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """:class:`TensorSpec` of ``keys`` (default: every tensor) in sorted key order; with ``dtype``,
    floating-point tensors are described as converted to it (as :func:`full_tensors` yields them)."""
    keys = sorted(manifest.tensors) if keys is None else sorted(keys)
    specs = []
    for key in keys:
        try:
            entry = manifest.tensors[key]
        except KeyError:
            raise CheckpointError(f"no tensor {key!r} in the checkpoint", tensor=key) from None
        specs.append(TensorSpec(key, converted_dtype(entry.dtype, dtype), tuple(entry.shape)))
    return specs


def converted_dtype(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """What a tensor stored as ``stored`` becomes under a ``dtype`` conversion (floats only)."""
    return dtype if dtype is not None and stored.is_floating_point else stored


# -- 2. read -----------------------------------------------------------------------------------
def full_tensors(path: str | os.PathLike | Location, keys: Iterable[str] | None = None, *,
                 dtype: torch.dtype | None = None, storage_options: dict | None = None,
                 manifest: Manifest | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for each of ``keys`` (default: every tensor, sorted), in that order, each
    assembled whole on the CPU from its verified, decoded chunks (deltas replayed through their
    chain; any mount). With ``dtype``, floating-point tensors are converted to it chunk by chunk;
    other tensors keep their dtype. One full tensor plus one chunk is held at a time (the caller
    should drop each tensor before asking for the next). ``manifest``: the checkpoint's, when the
    caller has already read it. A :class:`~ckpt.storage.Location` is used as it is (resolved by the caller)."""
    location = locate(path, storage_options)
    manifest = read_manifest(location) if manifest is None else manifest
    keys = sorted(manifest.tensors) if keys is None else list(keys)
    for key in keys:
        if key not in manifest.tensors:
            raise CheckpointError(f"{location}: no tensor {key!r}", path=str(location), tensor=key)
    source = ChunkSource(location, manifest)
    try:
        for key in keys:
            yield key, _assemble(source, key, dtype)
    finally:
        source.close()


def _assemble(source: ChunkSource, key: str, dtype: torch.dtype | None) -> torch.Tensor:
    entry = source.manifest.tensors[key]
    target = converted_dtype(entry.dtype, dtype)
    full = empty_tensor(tuple(entry.shape), target)
    direct = target == entry.dtype

    def requests():
        for chunk in entry.chunks:
            view = full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            yield view, key, chunk, view if direct and view.is_contiguous() else None

    for view, chunk in source.read_tensors(requests()):
        if chunk is not view:  # decoded into a temporary (a delta, zstd, a strided slice): copy it in
            view.copy_(chunk)
        del chunk
    return full


MMAP_MIN_BYTES = 1 << 20


def empty_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor; one of at least :data:`MMAP_MIN_BYTES` in its own anonymous mapping, which
    goes back to the system when the tensor is freed. From the heap, the freed tensors of a long
    merge are not reliably reused: glibc's adaptive mmap threshold moves tensors of up to 32 MiB
    into the heap, a small allocation landing in a freed tensor's hole leaves it too small for the
    next one, and the process's RSS creeps up towards the size of the whole state (seen: a 1 GiB
    merge to .pt growing by 0.96 GiB in a third of fresh processes, +0.14 GiB in the others)."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * dtype.itemsize
    if nbytes < MMAP_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # freed with the tensor
    if _HUGEPAGE is not None:  # fresh pages fault in 2 MiB at a time, not 4 KiB (~0.3 CPU-s less per GiB)
        try:
            buffer.madvise(_HUGEPAGE)
        except OSError:
            pass
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)

"""Weights files out: consolidated tensors streamed into ``.safetensors`` or ``torch.save`` files,
one file or a Hugging Face sharded directory, whole or not at all.

:func:`write_output` takes the specs of what it writes (:class:`~ckpt.convert.formats.TensorSpec`)
and the tensors, one at a time, in that order (each checked against its spec as it arrives). Every
file's layout is computed from the specs before the first tensor arrives (the safetensors header;
the torch zip's pickle: :mod:`ckpt.convert.formats`), then each tensor's bytes are appended as they
come. With ``max_shard_size`` the output is a directory in the Hugging Face layout
(``model-00001-of-00003.safetensors`` ... + ``model.safetensors.index.json``), shards planned from
the specs (:func:`plan_shards`). :func:`merge` is ``ckpt-merge``'s library call: a checkpoint's
selected tensors (:mod:`ckpt.convert.consolidate`) written this way, its step and kind in each
safetensors header (:func:`step_metadata`).

Outputs are never partial: a single file is a :class:`ckpt.commit.PendingFile`, a directory a
:class:`ckpt.commit.PendingDirectory` (published through the mount's commit strategy; the index last).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import commit
from ..read.committed import read_manifest
from ..errors import CheckpointError, CheckpointExistsError, CheckpointWriteError, UnsupportedFormatError
from ..format import Manifest
from ..storage import Location, locate
from ..write.files import tensor_bytes
from .consolidate import full_tensors, select_keys, tensor_specs
from .formats import FORMATS, SAFETENSORS_DTYPES, TensorSpec, TorchZipWriter, safetensors_header

# Hugging Face names: (single file, shard pattern, index) per format.
HF_NAMES = {
    "safetensors": ("model.safetensors", "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json"),
    "torch": ("pytorch_model.bin", "pytorch_model-{:05d}-of-{:05d}.bin", "pytorch_model.bin.index.json"),
}
# Planning bounds on what a file holds besides tensor bytes (so that a shard's FILE stays within
# max_shard_size): per tensor, its header entry / zip record headers + alignment + pickle entry;
# per file, the fixed parts (length prefix, metadata, zip end records, pickle preamble).
_PER_TENSOR_OVERHEAD = 384
_PER_FILE_OVERHEAD = 4096


# -- planning --------------------------------------------------------------------------------------
def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int, *, metadata_bytes: int = 0
                ) -> list[list[TensorSpec]]:
    """Greedy in spec order: a shard takes tensors while its file stays within ``max_shard_size``
    (tensor bytes + a bound on the file's own overhead); a tensor too large for any shard gets its
    own."""
    if max_shard_size <= 0:
        raise CheckpointError(f"max_shard_size must be positive, not {max_shard_size}")
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = _PER_FILE_OVERHEAD + metadata_bytes
    for spec in specs:
        cost = spec.nbytes + _PER_TENSOR_OVERHEAD + 2 * len(spec.key.encode())
        if current and size + cost > max_shard_size:
            shards.append(current)
            current, size = [], _PER_FILE_OVERHEAD + metadata_bytes
        current.append(spec)
        size += cost
    if current:
        shards.append(current)
    return shards


# -- writing ---------------------------------------------------------------------------------------
def write_output(dst: str | os.PathLike | Location, specs: Sequence[TensorSpec],
                 tensors: Iterable[tuple[str, torch.Tensor]], *, format: str, max_shard_size: int | None = None,
                 overwrite: bool = False, metadata: dict[str, str] | None = None,
                 progress: Callable[[int], Any] | None = None, storage_options: dict | None = None,
                 extra_files: dict[str, bytes] | None = None) -> list[str]:
    """Stream ``tensors`` (``(key, tensor)`` in the order of ``specs``, each matching its spec)
    into ``dst``: one file (``format`` ``"safetensors"`` or ``"torch"``), or with
    ``max_shard_size`` (bytes per file) a directory in the Hugging Face layout, shards planned from
    the specs before anything is written (one shard: ``model.safetensors`` / ``pytorch_model.bin``
    alone, as Hugging Face writes it; several: numbered shards + the index, whose
    ``metadata.total_size`` is the tensor bytes). ``metadata``: string pairs for each safetensors
    header (``format: pt`` is always there); the torch format holds tensors only. An existing
    ``dst`` is refused unless ``overwrite``; nothing partial is ever left. ``progress(n_bytes)``
    after each tensor. ``extra_files`` (name -> bytes; a directory output only) are published with
    the shards, before the index (a Hugging Face export's config.json). Returns the paths written. A
    :class:`~ckpt.storage.Location` ``dst`` is used as it is (resolved by the caller)."""
    if format not in FORMATS:
        raise UnsupportedFormatError(f"unknown output format {format!r} (one of {', '.join(FORMATS)})")
    specs = list(specs)
    if format == "safetensors":
        unsupported = [s for s in specs if s.dtype not in SAFETENSORS_DTYPES]
        if unsupported:
            raise UnsupportedFormatError(f"{unsupported[0].key}: dtype {unsupported[0].dtype} has no safetensors "
                                         f"code ({len(unsupported)} such tensor(s)); use --format torch")
    metadata = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    dst = locate(dst, storage_options)
    if extra_files and max_shard_size is None:
        raise CheckpointError("extra_files go into a directory output: give max_shard_size")
    with _Checked(specs, tensors, progress) as stream:
        if max_shard_size is None:
            _write_file(dst, specs, stream, format=format, overwrite=overwrite, metadata=metadata)
            return [str(dst)]
        return _write_sharded(dst, specs, stream, format=format, max_shard_size=max_shard_size, overwrite=overwrite,
                              metadata=metadata, extra_files=extra_files or {})


def _write_sharded(dst: Location, specs: list[TensorSpec], stream: "_Checked", *, format: str, max_shard_size: int,
                   overwrite: bool, metadata: dict[str, str], extra_files: dict[str, bytes]) -> list[str]:
    metadata_bytes = len(json.dumps(metadata)) if format == "safetensors" else 0
    shards = plan_shards(specs, max_shard_size, metadata_bytes=metadata_bytes)
    single, pattern, index_name = HF_NAMES[format]
    names = [single] if len(shards) <= 1 else [pattern.format(i + 1, len(shards)) for i in range(len(shards))]
    files: dict[str, bytes | list[TensorSpec]] = {**dict(zip(names, shards or [[]])), **extra_files}
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.key: name for name, shard in zip(names, shards) for s in shard}}
        files[index_name] = json.dumps(index, indent=2).encode() + b"\n"
    _write_directory(dst, files, stream, format=format, overwrite=overwrite, metadata=metadata)
    return [str(dst / name) for name in files]


class _Checked:
    """The caller's ``(key, tensor)`` stream, checked against the specs, one tensor at a time."""

    def __init__(self, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]], progress):
        self.specs, self.progress = specs, progress
        self.iterator = iter(tensors)
        self.position = 0

    def take(self, spec: TensorSpec) -> torch.Tensor:
        try:
            key, tensor = next(self.iterator)
        except StopIteration:
            raise CheckpointWriteError(f"the tensors ended before {spec.key!r}", tensor=spec.key) from None
        if key != spec.key:
            raise CheckpointWriteError(f"tensor {key!r} arrived where {spec.key!r} was planned", tensor=key)
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise CheckpointWriteError(
                f"{key}: got {tensor.dtype} {list(tensor.shape)}, planned {spec.dtype} {list(spec.shape)}", tensor=key)
        self.position += 1
        return tensor

    def done(self, spec: TensorSpec) -> None:
        if self.progress is not None:
            self.progress(spec.nbytes)

    def finish(self) -> None:
        """Every planned tensor written: the stream must end here (checked before publishing)."""
        extra = next(self.iterator, None)
        if extra is not None:
            raise CheckpointWriteError(f"tensor {extra[0]!r} arrived after the last planned one", tensor=extra[0])

    def __enter__(self) -> "_Checked":
        return self

    def __exit__(self, *exc) -> None:
        close = getattr(self.iterator, "close", None)  # a generator: its sources close now, not at gc
        if close is not None:
            close()


def _write_file(dst: Location, specs: list[TensorSpec], stream: _Checked, *, format: str, overwrite: bool,
                metadata: dict[str, str]) -> None:
    pending = commit.PendingFile(dst, overwrite=overwrite)
    try:
        _stream_into(pending.write, specs, stream, format=format, metadata=metadata)
        stream.finish()
        pending.publish()
    except BaseException:
        pending.abort()
        raise


def _stream_into(write: Callable[[Any], None], specs: list[TensorSpec], stream: _Checked, *, format: str,
                 metadata: dict[str, str]) -> None:
    """One file's bytes, sent to ``write`` as they become known."""
    if format == "safetensors":
        write(safetensors_header(((s.key, s.dtype, s.shape) for s in specs), metadata))
        for spec in specs:
            tensor = stream.take(spec)
            write(tensor_bytes(tensor))
            del tensor
            stream.done(spec)
        return
    archive = TorchZipWriter(write, specs)
    try:
        for index, spec in enumerate(specs):
            tensor = stream.take(spec)
            archive.add(index, tensor)
            del tensor
            stream.done(spec)
        archive.finish()
    except BaseException:
        archive.discard()
        raise


def _write_directory(dst: Location, files: dict[str, Any], stream: _Checked, *, format: str, overwrite: bool,
                     metadata: dict[str, str]) -> None:
    """Write ``files`` (name -> specs of a shard, or bytes; the index last) as the directory ``dst``,
    whole or not at all (:class:`ckpt.commit.PendingDirectory`)."""
    with commit.PendingDirectory(dst, overwrite=overwrite) as out:
        for name, content in files.items():
            if isinstance(content, bytes):
                stream.finish()  # every tensor is in its shard before the small files and the index
                out.write_bytes(name, content)
                continue
            handle = out.create(name)
            try:
                _stream_into(handle.write, content, stream, format=format, metadata=metadata)
                handle.close()
            except BaseException:
                handle.abort()
                raise
        stream.finish()


# -- ckpt-merge ------------------------------------------------------------------------------------
def step_metadata(manifest: Manifest) -> dict[str, str]:
    """The strings an export's safetensors header records of the checkpoint it came from: its kind
    (``ckpt.kind``) and, when it has one, its step (``ckpt.step``)."""
    return {"ckpt.kind": manifest.kind, **({"ckpt.step": str(manifest.step)} if manifest.step is not None else {})}


def merge(source: str | Location, dst: str | Location, *, format: str, dtype: torch.dtype | None = None,
          only: str | None = None, max_shard_size: int | None = None, overwrite: bool = False,
          progress=None, storage_options: dict | None = None, manifest: Manifest | None = None) -> list[str]:
    """The library path of ckpt-merge: the tensors of the checkpoint ``source`` (selected by
    ``only``, floats converted to ``dtype``) written to ``dst``; returns the paths written."""
    source = locate(source, storage_options)
    manifest = read_manifest(source) if manifest is None else manifest
    keys = select_keys(manifest, only)
    specs = tensor_specs(manifest, keys, dtype=dtype)
    tensors = full_tensors(source, [s.key for s in specs], dtype=dtype, manifest=manifest)
    return write_output(dst, specs, tensors, format=format, max_shard_size=max_shard_size, overwrite=overwrite,
                        metadata=step_metadata(manifest), progress=progress, storage_options=storage_options)

"""Consolidation: a committed checkpoint's tensors, whole, streamed into weights files.

The core of every export (``ckpt-merge``, ``ckpt-convert``). Three steps, each bounded in memory:

1. choose   :func:`select_keys` picks tensor keys (all, ``model``, ``optim`` or any key prefix) and
            :func:`tensor_specs` describes them (key, dtype, global shape) from the manifest alone;
2. read     :func:`full_tensors` assembles one tensor at a time from its chunks through
            :class:`ckpt.read.ChunkSource` (so every chunk is verified, deltas are replayed through
            their chain and every mount works): the global shape is allocated once and each decoded
            chunk is copied into its slice (a raw chunk is read straight into it);
3. write    :func:`write_output` streams them into ``.safetensors`` or ``torch.save`` files: every
            file's layout is computed from the specs before the first tensor arrives (the
            safetensors header; the torch zip's pickle), then each tensor's bytes are appended as
            they come. With ``max_shard_size`` the output is a directory in the Hugging Face layout
            (``model-00001-of-00003.safetensors`` ... + ``model.safetensors.index.json``).

Peak memory is one full tensor plus one chunk, whatever the size of the checkpoint. Outputs are
never partial: a single file is a :class:`ckpt.commit.PendingFile`; a directory is written under a
temporary sibling (``<dst>.tmp-<id>``) and renamed at the end (local mounts; on object stores the
index is written last and a failure removes what was written).

The ``torch`` format is the one ``torch.save`` writes (a zip: ``data.pkl`` + one record per
storage), produced without building the state dict: the pickle of the flat ``{key: tensor}`` dict
is made from the specs (tensors rebuilt by ``torch._utils._rebuild_tensor_v2``/``_v3`` over
persistent storage ids, exactly as ``torch.save`` pickles them), then each storage record is written
into the zip by ``torch._C.PyTorchFileWriter`` as its tensor arrives. ``torch.load(path,
weights_only=True)`` returns the dict.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import mmap
import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from . import commit
from .committed import read_manifest
from .errors import CheckpointError, CheckpointExistsError, CheckpointWriteError, UnsupportedFormatError
from .format import Manifest
from .merged import SAFETENSORS_DTYPES, safetensors_header
from .read import ChunkSource
from .storage import Location, locate
from .write import tensor_bytes

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "torch")
GROUPS = {"model": "model.", "optim": "optim."}
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


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an output: its key, dtype and global shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


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
    caller has already read it."""
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


# -- 3. write ----------------------------------------------------------------------------------
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


def write_output(dst: str | os.PathLike | Location, specs: Sequence[TensorSpec],
                 tensors: Iterable[tuple[str, torch.Tensor]], *, format: str, max_shard_size: int | None = None,
                 overwrite: bool = False, metadata: dict[str, str] | None = None,
                 progress: Callable[[int], Any] | None = None, storage_options: dict | None = None) -> list[str]:
    """Stream ``tensors`` (``(key, tensor)`` in the order of ``specs``, each matching its spec)
    into ``dst``: one file (``format`` ``"safetensors"`` or ``"torch"``), or with
    ``max_shard_size`` (bytes per file) a directory in the Hugging Face layout, shards planned from
    the specs before anything is written (one shard: ``model.safetensors`` / ``pytorch_model.bin``
    alone, as Hugging Face writes it; several: numbered shards + the index, whose
    ``metadata.total_size`` is the tensor bytes). ``metadata``: string pairs for each safetensors
    header (``format: pt`` is always there); the torch format holds tensors only. An existing
    ``dst`` is refused unless ``overwrite``; nothing partial is ever left. ``progress(n_bytes)``
    after each tensor. Returns the paths written."""
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
    with _Checked(specs, tensors, progress) as stream:
        if max_shard_size is None:
            _write_file(dst, specs, stream, format=format, overwrite=overwrite, metadata=metadata)
            return [str(dst)]
        return _write_sharded(dst, specs, stream, format=format, max_shard_size=max_shard_size, overwrite=overwrite,
                              metadata=metadata)


def _write_sharded(dst: Location, specs: list[TensorSpec], stream: "_Checked", *, format: str, max_shard_size: int,
                   overwrite: bool, metadata: dict[str, str]) -> list[str]:
    metadata_bytes = len(json.dumps(metadata)) if format == "safetensors" else 0
    shards = plan_shards(specs, max_shard_size, metadata_bytes=metadata_bytes)
    single, pattern, index_name = HF_NAMES[format]
    names = [single] if len(shards) <= 1 else [pattern.format(i + 1, len(shards)) for i in range(len(shards))]
    files: dict[str, bytes | list[TensorSpec]] = dict(zip(names, shards or [[]]))
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
    """Write ``files`` (name -> specs of a shard, or bytes) as the directory ``dst``, whole or not at all."""
    storage = dst.storage
    storage.makedirs(dst.parent.path)
    if storage.atomic_rename:
        commit.collect_garbage(dst)  # leftovers of dead exports to the same dst
        if dst.exists() and not overwrite:
            raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True to replace it", path=str(dst))
        tmp = dst.parent / f"{dst.name}{commit.TMP_MARK}{commit._new_tag()}"
        storage.makedirs(tmp.path)
        try:
            _write_files(tmp, files, stream, format=format, metadata=metadata)
            storage.sync_dir(tmp.path)
            commit._publish(tmp, dst, overwrite=overwrite)
        except BaseException:
            storage.remove_tree(tmp.path)
            raise
        return
    # Object stores: no rename. Files go straight under dst, the index last; a failure removes them.
    existed = dst.exists()
    if existed and not overwrite:
        raise CheckpointExistsError(f"{dst} already exists; pass overwrite=True to replace it", path=str(dst))
    before = set(dst.list()) if existed else set()
    storage.makedirs(dst.path)
    try:
        _write_files(dst, files, stream, format=format, metadata=metadata)
    except BaseException:
        for name in files:
            if name not in before:
                storage.remove((dst / name).path)
        raise
    for name in before - set(files):  # an overwritten export's other files
        if storage.is_file((dst / name).path):
            storage.remove((dst / name).path)


def _write_files(directory: Location, files: dict[str, Any], stream: _Checked, *, format: str,
                 metadata: dict[str, str]) -> None:
    storage = directory.storage
    for name, content in files.items():  # shards first, the index last
        path = (directory / name).path
        if isinstance(content, bytes):
            stream.finish()
            storage.write_bytes(path, content)
            continue
        handle = storage.create(path)
        try:
            _stream_into(handle.write, content, stream, format=format, metadata=metadata)
            handle.close()
        except BaseException:
            handle.abort()
            raise
    stream.finish()


# -- the torch.save format ---------------------------------------------------------------------
_TYPED_STORAGES = torch.storage._dtype_to_storage_type_map()  # dtype -> "FloatStorage" etc. (torch.save's v2 path)


class _StorageRef:
    def __init__(self, record: str, dtype: torch.dtype, numel: int):
        self.record, self.dtype, self.numel = record, dtype, numel


class _TensorRef:
    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class _SpecPickler(pickle.Pickler):
    """Pickles ``{key: _TensorRef}`` into what ``torch.save`` writes for ``{key: tensor}``: the
    reduce of ``torch.Tensor.__reduce_ex__`` (``_rebuild_tensor_v2`` over a typed storage, or
    ``_rebuild_tensor_v3`` over an untyped one for the dtypes without a typed storage) and the
    persistent id of ``torch.serialization._save`` for the storage."""

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            if obj.dtype in _TYPED_STORAGES:
                return ("storage", getattr(torch, _TYPED_STORAGES[obj.dtype]), obj.record, "cpu", obj.numel)
            return ("storage", torch.UntypedStorage, obj.record, "cpu", obj.numel * obj.dtype.itemsize)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, _TensorRef):
            shape = obj.shape
            args = (obj.storage, 0, torch.Size(shape), _contiguous_stride(shape), False, collections.OrderedDict())
            if obj.storage.dtype in _TYPED_STORAGES:
                return torch._utils._rebuild_tensor_v2, args
            return torch._utils._rebuild_tensor_v3, args + (obj.storage.dtype,)
        return NotImplemented


class _Sink:
    """The file-like object ``PyTorchFileWriter`` writes to. It never raises into the C++ writer
    (whose byte count would then disagree with the file, and whose destructor aborts the process on
    that): a failed write is kept in :attr:`error`, raised by :class:`TorchZipWriter` when the call
    returns, and everything after it (or after :meth:`TorchZipWriter.discard`) is dropped."""

    def __init__(self, write: Callable[[Any], None]):
        self._write = write
        self.dead = False
        self.error: BaseException | None = None

    def write(self, data) -> int:
        if not self.dead:
            try:
                self._write(data)
            except BaseException as exc:  # noqa: BLE001 - handed back by TorchZipWriter._check
                self.error, self.dead = exc, True
        return len(data)

    def flush(self) -> None:
        pass


class TorchZipWriter:
    """A ``torch.save`` zip of ``{spec.key: tensor}`` written record by record: the pickle (from
    the specs) first, then :meth:`add` per tensor in spec order, then :meth:`finish`."""

    def __init__(self, write: Callable[[Any], None], specs: Sequence[TensorSpec]):
        from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, get_crc32_options

        self.specs = list(specs)
        self.sink = _Sink(write)
        try:
            self.zip = torch._C.PyTorchFileWriter(self.sink, get_crc32_options(), _get_storage_alignment())
        except TypeError:  # older signatures
            self.zip = torch._C.PyTorchFileWriter(self.sink)
        refs = {s.key: _TensorRef(_StorageRef(str(i), s.dtype, s.numel), s.shape) for i, s in enumerate(self.specs)}
        buffer = io.BytesIO()
        _SpecPickler(buffer, protocol=DEFAULT_PROTOCOL).dump(refs)
        self._record("data.pkl", buffer.getvalue())
        self._record(".format_version", b"1")  # storages named by number
        self._record(".storage_alignment", str(_get_storage_alignment()).encode())
        self._record("byteorder", sys.byteorder.encode())
        self.next = 0

    def _record(self, name: str, data: bytes) -> None:
        self.zip.write_record(name, data, len(data))
        self._check()

    def _check(self) -> None:
        if self.sink.error is not None:
            error, self.sink.error = self.sink.error, None
            raise error

    def add(self, index: int, tensor: torch.Tensor) -> None:
        if index != self.next:
            raise CheckpointWriteError(f"torch zip: record {index} written out of order (expected {self.next})")
        spec = self.specs[index]
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        storage = tensor.untyped_storage()
        if not tensor.is_contiguous() or tensor.storage_offset() != 0 or storage.nbytes() != spec.nbytes:
            tensor = tensor.contiguous().clone() if tensor.is_contiguous() else tensor.contiguous()
            storage = tensor.untyped_storage()
        self.zip.write_record(f"data/{index}", storage, spec.nbytes)
        self._check()
        self.next += 1

    def finish(self) -> None:
        if self.next != len(self.specs):
            raise CheckpointWriteError(f"torch zip: {len(self.specs) - self.next} tensor(s) never arrived")
        self.zip.write_end_of_file()
        self._check()

    def discard(self) -> None:
        """After a failure: write nothing more (the writer's destructor would finish the zip)."""
        self.sink.dead = True

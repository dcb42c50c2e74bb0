"""The two weights-file formats an export writes, each streamed: its layout is known from the
tensors' specs (key, dtype, shape) before the first tensor arrives, so a writer puts it first and
then appends each tensor's bytes as it comes.

* safetensors  :func:`safetensors_header`: the 8-byte little-endian length, then the JSON header
               (names, dtypes as :data:`SAFETENSORS_DTYPES` codes, shapes, data offsets, string
               metadata), padded to 8 bytes; the tensors' bytes follow back to back in that order.
* torch        :class:`TorchZipWriter`: the zip ``torch.save`` writes (``data.pkl`` + one record per
               storage), produced without building the state dict: the pickle of the flat
               ``{key: tensor}`` dict is made from the specs (tensors rebuilt by
               ``torch._utils._rebuild_tensor_v2``/``_v3`` over persistent storage ids, exactly as
               ``torch.save`` pickles them), then each storage record is written into the zip by
               ``torch._C.PyTorchFileWriter`` as its tensor arrives. ``torch.load(path,
               weights_only=True)`` returns the dict.

Only bytes and the callables they are handed to: where the bytes go (one file, shards, publishing)
is :mod:`ckpt.convert.export`'s; the merged save (:mod:`ckpt.convert.merged`) writes a safetensors
header too.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import CheckpointWriteError, UnsupportedFormatError

FORMATS = ("safetensors", "torch")

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


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


# -- safetensors -----------------------------------------------------------------------------------
def safetensors_header(tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]], metadata: dict[str, str]) -> bytes:
    """The header of a ``.safetensors`` file whose data section holds ``tensors`` (name, dtype,
    shape) back to back in the order given: the 8-byte little-endian length, then the JSON (padded
    with spaces to a multiple of 8 bytes, as safetensors aligns its data section). Built from
    metadata alone, so a writer can put it first and stream the tensors after it
    (:mod:`ckpt.convert.export`, :mod:`ckpt.convert.merged`)."""
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


# -- torch.save ------------------------------------------------------------------------------------
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

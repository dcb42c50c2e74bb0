"""The items of a DCP checkpoint's data files, read safely: bytes, transforms undone, loaded, checked.

``FileSystemWriter`` (torch 2.13, its default ``TORCH_SAVE`` serialization) writes per rank
``<dir>/__<rank>_<n>.distcp`` (``n``: one file per writer thread, or per item), items back to back:
each tensor chunk a ``torch.save`` stream (a zip) of the chunk as a tensor, each non-tensor value a
``torch.save`` of the value; each optionally passed through stream transforms (only
``stream.zstd/1`` exists) listed in its ``transform_descriptors``.

DCP reads values with ``torch.load(weights_only=False)``, which executes code from a hostile
checkpoint. :class:`ItemReader` reads every item with ``torch.load(weights_only=True)`` on exactly the
item's bytes (:class:`~ckpt.errors.UnsafeCheckpointError` for what it refuses), bounds what a
decompression may yield, and checks every chunk against the metadata's dtype and box
(:class:`~ckpt.errors.CorruptCheckpointError`): an item is checked from its first and last bytes
before it is read whole, a declared zstd content size before it is decompressed, a value's
structure within :mod:`ckpt.convert.dcp.bounds`' limits before it is walked. One :class:`Item` per stored chunk or value is
matched to its place in the metadata by :mod:`ckpt.convert.dcp.importer`.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
from typing import Any, Callable

import numpy as np
import torch
import zstandard
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...read.committed import DCP_METADATA_NAME as METADATA_NAME
from ...errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError, UnsupportedFormatError
from ...format import ValueEntry, values
from ...storage import Location
from ...write.files import tensor_bytes
from .bounds import check_structure, element_budget

MAX_VALUE_BYTES = 1 << 30  # a decompressed non-tensor value
MAX_VALUE_DEPTH = 100  # nesting of a value (a training state's values nest a few levels)
STREAM_SLACK = 1 << 20  # a torch.save zip around a chunk's bytes: headers, data.pkl, 64-byte padding
ZSTD = "stream.zstd"
_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"  # the end of central directory record, in a zip's last 64 KiB
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclasses.dataclass
class Item:
    """One stored chunk or value of a DCP checkpoint: its key and where DCP put it."""

    key: str
    info: _StorageInfo
    offsets: tuple | None = None  # a tensor chunk's box; None for a value
    sizes: tuple | None = None
    dtype: torch.dtype | None = None


def transform(descriptor: str, src: Location, key: str) -> str:
    """The stream transforms this reads: ``stream.zstd/1`` (DCP's ZStandard extension)."""
    name, _, version = descriptor.partition("/")
    if name == ZSTD and version.partition(".")[0] == "1":
        return ZSTD
    raise UnsupportedFormatError(f"{src}: {key!r} is stored through the stream transform {descriptor!r}, which "
                                 "this cannot read", path=str(src), file=METADATA_NAME, tensor=key)



class ItemReader:
    """Items of a DCP checkpoint's data files, read, untransformed, decoded and checked."""

    def __init__(self, src: Location):
        self.src = src
        self._open: tuple[str, Any] | None = None  # one data file open at a time (files are done in turn)

    def _stream(self, item: Item, limit: int) -> bytes:
        """The item's bytes with its transforms undone (at most ``limit`` bytes after them)."""
        rel, info = item.info.relative_path, item.info
        if self._open is None or self._open[0] != rel:
            self.close()
            self._open = (rel, self.src.storage.open_read(self.src.path, rel))
        handle = self._open[1]
        if info.offset + info.length > handle.size:
            raise CorruptCheckpointError(f"{self.src}: {rel} is truncated ({handle.size} bytes) - {item.key} "
                                         f"needs bytes {info.offset}..{info.offset + info.length}",
                                         path=str(self.src), file=rel, tensor=item.key)
        self._check_ends(handle, item)
        data = bytearray(info.length)
        if handle.read_into(memoryview(data), info.offset) != info.length:
            raise CorruptCheckpointError(f"{self.src}: short read of {item.key} from {rel}", path=str(self.src),
                                         file=rel, tensor=item.key)
        for descriptor in info.transform_descriptors or ():
            transform(descriptor, self.src, item.key)
            data = self._unzstd(data, limit, item)
        if bytes(data[:4]) != _ZIP_MAGIC:
            raise self._not_torch_save(item)
        return bytes(data)

    def _check_ends(self, handle, item: Item) -> None:
        """Before the item is read whole: it begins as a zstd frame or a zip (a torch.save stream),
        and an untransformed one ends with a zip's end record; a sparse file of zeros claiming
        gigabytes is refused from a few bytes."""
        info, rel = item.info, item.info.relative_path
        head = bytearray(min(info.length, 4))
        handle.read_into(memoryview(head), info.offset)
        tail = bytearray(min(info.length, 1 << 16))
        handle.read_into(memoryview(tail), info.offset + info.length - len(tail))
        if info.transform_descriptors:
            if bytes(head) != _ZSTD_MAGIC:
                raise CorruptCheckpointError(f"{self.src}: {item.key} in {rel} is not a zstd frame",
                                             path=str(self.src), file=rel, tensor=item.key)
        elif bytes(head) != _ZIP_MAGIC:
            raise self._not_torch_save(item)
        elif _ZIP_END not in tail:
            end = info.offset + info.length
            raise CorruptCheckpointError(f"{self.src}: {item.key} in {rel} (bytes {info.offset}..{end}) does not end "
                                         "as a torch.save stream (truncated, or a sparse file claiming more than "
                                         "it holds)", path=str(self.src), file=rel, tensor=item.key)

    def _not_torch_save(self, item: Item) -> UnsupportedFormatError:
        return UnsupportedFormatError(
            f"{self.src}: {item.key} in {item.info.relative_path} is not a torch.save stream (FileSystemWriter's "
            "SAFETENSORS serialization, a custom planner's own bytes, or a damaged file); only DCP's default "
            "TORCH_SAVE serialization is read",
            path=str(self.src), file=item.info.relative_path, tensor=item.key)

    def _unzstd(self, data: bytearray, limit: int, item: Item) -> bytearray:
        try:
            declared = zstandard.frame_content_size(bytes(data[:18]))
        except zstandard.ZstdError:
            declared = -1  # not given, or a damaged header (the decompressor names it)
        if declared > limit:
            raise CorruptCheckpointError(f"{self.src}: {item.key} in {item.info.relative_path} declares {declared} "
                                         f"bytes when decompressed, more than the {limit} it can hold",
                                         path=str(self.src), file=item.info.relative_path, tensor=item.key)
        out = bytearray()
        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as stream:
                while len(out) <= limit:
                    piece = stream.read(1 << 20)
                    if not piece:
                        break
                    out += piece
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"{self.src}: {item.key} in {item.info.relative_path} does not "
                                         f"decompress ({exc})", path=str(self.src), file=item.info.relative_path,
                                         tensor=item.key) from None
        if len(out) > limit:
            raise CorruptCheckpointError(f"{self.src}: {item.key} in {item.info.relative_path} decompresses to "
                                         f"more than the {limit} bytes it can hold", path=str(self.src),
                                         file=item.info.relative_path, tensor=item.key)
        return out

    def _load(self, data: bytes, item: Item) -> Any:
        """``torch.load(weights_only=True)`` of exactly these bytes; never anything weaker."""
        rel = item.info.relative_path
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            reason = str(exc).strip().splitlines()
            raise UnsafeCheckpointError(
                f"{self.src}: {item.key!r} in {rel} cannot be loaded without executing code from the checkpoint "
                f"(torch.load(weights_only=True) refused it: {reason[0][:200] if reason else 'unsafe'}); refused",
                path=str(self.src), file=rel, tensor=item.key) from None
        except MemoryError:
            raise CheckpointError(f"{self.src}: {item.key!r} in {rel} does not fit in memory", path=str(self.src),
                                  file=rel, tensor=item.key) from None
        except Exception as exc:
            raise CorruptCheckpointError(f"{self.src}: {item.key!r} in {rel} is not a readable torch.save stream "
                                         f"({type(exc).__name__}: {str(exc)[:200]})", path=str(self.src), file=rel,
                                         tensor=item.key) from None

    def chunk(self, item: Item, progress: Callable[[int], None] | None) -> np.ndarray:
        """The chunk's raw bytes, checked against its dtype and box."""
        nbytes = math.prod(item.sizes) * item.dtype.itemsize
        tensor = self._load(self._stream(item, nbytes + STREAM_SLACK), item)
        rel = item.info.relative_path
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided or \
                tensor.device.type != "cpu" or tensor.is_quantized or tensor.dtype != item.dtype or tuple(tensor.shape) != item.sizes:
            got = (f"{tensor.dtype} {list(tensor.shape)} on {tensor.device.type}" if isinstance(tensor, torch.Tensor)
                   else type(tensor).__name__)
            raise CorruptCheckpointError(f"{self.src}: the chunk of {item.key!r} at {list(item.offsets)} in {rel} "
                                         f"holds {got}; the metadata says {item.dtype} {list(item.sizes)}",
                                         path=str(self.src), file=rel, tensor=item.key)
        if tensor.untyped_storage().nbytes() < nbytes:  # an expanded view: no bigger than what was stored
            raise CorruptCheckpointError(f"{self.src}: the chunk of {item.key!r} in {rel} is a view larger than "
                                         "its stored bytes", path=str(self.src), file=rel, tensor=item.key)
        raw = tensor_bytes(tensor)
        if progress is not None:
            progress(raw.nbytes)
        return raw

    def value(self, item: Item) -> ValueEntry | bytes:
        """A non-tensor value: a tagged-JSON record, or the bytes of a ``torch.save`` stream of it
        (written by us, proven to load with ``weights_only=True``)."""
        raw = self._stream(item, MAX_VALUE_BYTES)
        value = self._load(raw, item)
        check_structure(value, budget=element_budget(len(raw)), max_depth=MAX_VALUE_DEPTH,
                        what=f"{self.src}: the value {item.key!r} in {item.info.relative_path}",
                        error=CorruptCheckpointError, path=str(self.src), file=item.info.relative_path,
                        tensor=item.key)
        try:
            return ValueEntry("json", value=values.encode(value))
        except (values.NotJSONable, RecursionError):
            pass
        stream = io.BytesIO()
        torch.save(value, stream)
        data = stream.getvalue()
        self._load(data, item)
        return data

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

"""The write side of a save: encode → balance → data files → manifest.

Each rank writes its share of DCP's plan (:func:`write_rank`):

1. encode   each chunk's raw bytes become what is stored (:class:`ChunkEncoder`): a lossless delta
            against the same chunk of the base snapshot when the save is a delta, zstd byte planes
            when compression is on, else the raw bytes; plain values go inline into the manifest
            as tagged JSON (a ``torch.save`` stream in a data file only when JSON cannot hold them);
2. balance  payloads are split over ``files_per_rank`` files of similar size, plan order kept;
3. write    each file is written by its own thread (:func:`write_file`): payloads produced lazily,
            encoded ahead on a pool, hashed (xxh3-64 per 1 MiB block, :mod:`ckpt.format.blocks`) on a
            helper thread while written, chunks of 64 KiB or more 4 KiB-aligned, the block tables
            after the file's last blob, writeback started early, the file fsync'd at the end;
4. record   every payload's blob becomes a record at its :class:`Place` (a
            :class:`~ckpt.format.Chunk` or :class:`~ckpt.format.ValueEntry`); the coordinator
            assembles the manifest from all ranks' records (:func:`ckpt.write.assemble.build_manifest`)
            and :mod:`ckpt.commit` publishes it.
"""

from __future__ import annotations

import io
import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .delta import DeltaBase
from ..errors import UnsafeCheckpointError
from ..format import Blob, Chunk, ValueEntry, codec, data_file_name, values
from ..format.blobs import ALIGN_MIN_BYTES, aligned
from ..format.blocks import BLOCK_SIZE, hash_blob
from ..format.codec import Encoded
from ..format.values import Leaf
from ..options import Compression, SaveOptions
from ..storage import Location


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array on the host (a view when already host-contiguous)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy()


# -- 1. encode -----------------------------------------------------------------------------------

class ChunkEncoder:
    """A chunk's raw bytes → what is stored: a delta against the base's same chunk when there is
    one, zstd byte planes when compression is on, else the raw bytes."""

    def __init__(self, compress: Compression, base: DeltaBase | None, level: int):
        self.compress, self.base, self.level = compress, base, level
        self.active = compress is not Compression.NONE or base is not None

    def __call__(self, item: WriteItem, raw: np.ndarray) -> np.ndarray | Encoded:
        if not self.active:
            return raw
        dtype = item.tensor_data.properties.dtype
        previous = None if self.base is None else self.base.chunk(item.index, dtype, item.tensor_data.chunk.sizes)
        if previous is not None:
            return codec.encode_delta(raw, tensor_bytes(previous), dtype.itemsize, self.level)
        if self.compress is Compression.ZSTD:
            return codec.encode_planes(raw, dtype.itemsize, self.level)
        return raw


def _value_record(item: WriteItem, planner: SavePlanner) -> ValueEntry | Callable[[], bytes]:
    """A non-tensor value: inline tagged JSON when JSON can hold it, else (a producer of) a
    ``torch.save`` stream that is proven at save time to load with ``weights_only=True`` — a value
    that would need code execution to load is refused now, not discovered at load time."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:  # a foreign planner: its own stream, checked the same way
        return lambda: _loadable(bytes(planner.resolve_data(item).getbuffer()), item.index.fqn)
    return value_record(item.index.fqn, lookup(item.index))


def value_record(key: str, value) -> ValueEntry | Callable[[], bytes]:
    """The record of the value ``key`` (see :func:`_value_record`): inline tagged JSON, else a
    producer of its checked ``torch.save`` stream."""
    value = value.value if isinstance(value, Leaf) else value  # the user's value, not our wrapper
    try:
        return ValueEntry("json", value=values.encode(value))
    except values.NotJSONable:
        pass
    stream = io.BytesIO()
    torch.save(value, stream)
    return lambda: _loadable(stream.getvalue(), key)


def _loadable(data: bytes, key: str) -> bytes:
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise UnsafeCheckpointError(
            f"value {key!r} cannot be saved: neither JSON nor torch.load(weights_only=True) can hold it, so "
            f"loading it would need code execution ({type(exc).__name__}). "
            "Store plain data (numbers, strings, bytes, lists, tuples, dicts, sets, NumPy arrays, tensors) "
            "or an object with state_dict()/load_state_dict()", tensor=key) from None
    return data


@dataclass
class Payload:
    """One thing to store: ``produce()`` returns its bytes (or an :class:`~ckpt.format.codec.Encoded`)
    when it is written."""

    key: object  # handed back with the resulting Blob
    produce: Callable[[], np.ndarray | bytes | Encoded]
    nbytes: int  # estimate, for balancing work across files


@dataclass(frozen=True)
class Place:
    """Where a blob goes in the manifest: a chunk of the tensor ``key`` (its box: ``offsets``,
    ``sizes``) or, without a box, the value ``key`` stored with ``encoding``."""

    key: str
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None
    encoding: str = "torch_save"

    def record(self, blob: Blob) -> Chunk | ValueEntry:
        """The manifest record of ``blob`` stored here."""
        if self.offsets is None:
            return ValueEntry(self.encoding, blob=blob)
        return Chunk(tuple(self.offsets), tuple(self.sizes), blob)


def write_rank(directory: Location, rank: int, items: list[WriteItem], planner: SavePlanner, options: SaveOptions,
               base: DeltaBase | None = None, tag: str = "") -> list[WriteResult]:
    """Write this rank's share of a save under ``directory`` (data files named with the attempt's
    ``tag``, see :mod:`ckpt.commit`); one WriteResult (a record) per item."""
    encoder = ChunkEncoder(options.compress, base, options.zstd_level)
    results: list[WriteResult] = []
    payloads: list[Payload] = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            record = _value_record(item, planner)
            if isinstance(record, ValueEntry):
                results.append(WriteResult(item.index, len(json.dumps(record.value)), record))
            else:
                payloads.append(Payload(item, record, 0))
        else:
            produce = lambda item=item: encoder(item, tensor_bytes(planner.resolve_data(item)))  # noqa: E731
            payloads.append(Payload(item, produce, item.tensor_storage_size() or 0))
    threads = options.encode_threads or os.cpu_count() or 1
    encoders = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-encode") if encoder.active else None
    try:
        buckets = _balance(payloads, options.files_per_rank)
        with ThreadPoolExecutor(len(buckets), thread_name_prefix="ckpt-write") as writers:
            futures = [
                writers.submit(write_file, directory, data_file_name(rank, part, tag), bucket,
                               encoders=encoders, window=2 * threads)
                for part, bucket in enumerate(buckets)
            ]
            for future in futures:
                results.extend(WriteResult(item.index, blob.length, _record(item, blob))
                               for item, blob in future.result())
    finally:
        if encoders is not None:
            encoders.shutdown(wait=True)
    return results


def _record(item: WriteItem, blob: Blob) -> Chunk | ValueEntry:
    if item.type == WriteItemType.BYTE_IO:
        return Place(item.index.fqn).record(blob)
    chunk = item.tensor_data.chunk
    return Place(item.index.fqn, chunk.offsets, chunk.sizes).record(blob)


# -- 2. balance ----------------------------------------------------------------------------------

def _balance(payloads: list[Payload], files: int) -> list[list[Payload]]:
    """Split payloads into at most ``files`` buckets of similar size, keeping plan order inside each."""
    files = min(files, max(1, len(payloads)))
    if files == 1:
        return [payloads]
    sizes = [0] * files
    owner = {}
    for index in sorted(range(len(payloads)), key=lambda i: -payloads[i].nbytes):
        target = sizes.index(min(sizes))
        owner[index] = target
        sizes[target] += payloads[index].nbytes
    buckets: list[list[Payload]] = [[] for _ in range(files)]
    for index, payload in enumerate(payloads):
        buckets[owner[index]].append(payload)
    return [b for b in buckets if b]


# -- 3. data files -------------------------------------------------------------------------------

def _in_order(payloads: Iterable[Payload], pool: ThreadPoolExecutor | None, window: int):
    """``(payload, produced)`` in order; with a pool, up to ``window`` payloads are produced ahead
    (encoding in parallel while earlier ones are written)."""
    if pool is None:
        for payload in payloads:
            yield payload, payload.produce()
        return
    pending: deque = deque()
    for payload in payloads:
        pending.append((payload, pool.submit(payload.produce)))
        if len(pending) >= window:
            done, future = pending.popleft()
            yield done, future.result()
    while pending:
        done, future = pending.popleft()
        yield done, future.result()


# below this a blob is never aligned; it is hashed inline (a thread hop costs more) and written with its neighbours
SMALL_BLOB_BYTES = ALIGN_MIN_BYTES
SMALL_WRITE_BYTES = 1 << 20  # small blobs gathered up to this, then written in one call


class _Hashed:
    """A blob's ``(checksum, table)`` computed inline, read as the helper thread's futures are."""

    def __init__(self, value: tuple[str, bytes | None]):
        self.value = value

    def result(self) -> tuple[str, bytes | None]:
        return self.value


def write_file(directory: Location, rel_name: str, payloads: Iterable[Payload], *,
               encoders: ThreadPoolExecutor | None = None, window: int = 4) -> list[tuple[object, Blob]]:
    """Write ``payloads`` into the new file ``directory/rel_name``, durably (see
    :class:`~ckpt.storage.base.WriteHandle`); return where each one went. Each blob is hashed per
    block on a helper thread while the next is written; the block tables follow the last blob.
    Small blobs (a norm weight, an optimizer's step: most of a state's leaves) are hashed inline and
    gathered into one write, the bytes in the file the same: per leaf, a thread hop and a system
    call cost more than the bytes."""
    placed: list[tuple[object, int, int, Future | _Hashed, Encoded | None]] = []
    tables: dict[int, int] = {}  # index in placed -> where its block table went
    handle = directory.storage.create((directory / rel_name).path)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as hasher:
            end, gathered = 0, bytearray()
            for payload, data in _in_order(payloads, encoders, window):
                encoded = data if isinstance(data, Encoded) else None
                view = memoryview(encoded.data if encoded else data).cast("B")
                if len(view) < SMALL_BLOB_BYTES:  # never aligned (ALIGN_MIN_BYTES): right after the last
                    digest = _Hashed(hash_blob(view, BLOCK_SIZE))
                    start = end
                    gathered += view
                    if len(gathered) >= SMALL_WRITE_BYTES:
                        handle.write(gathered)
                        gathered = bytearray()  # a new one: the handle may keep what it was given
                else:
                    start = aligned(end, len(view))
                    if gathered:
                        handle.write(gathered)
                        gathered = bytearray()
                    if start > end:
                        handle.write(bytes(start - end))
                    digest = hasher.submit(hash_blob, view, BLOCK_SIZE)
                    handle.write(view)
                end = start + len(view)
                placed.append((payload.key, start, len(view), digest, encoded))
            if gathered:
                handle.write(gathered)
        for index, (_key, _start, _length, digest, _enc) in enumerate(placed):
            table = digest.result()[1]
            if table is not None:
                tables[index] = end
                handle.write(table)
                end += len(table)
        handle.close()
    except BaseException:
        handle.abort()
        raise
    return [
        (key, Blob(file=rel_name, offset=start, length=length, checksum=digest.result()[0],
                   **({} if enc is None else {"codec": enc.codec, "raw_length": enc.raw_length, "planes": enc.planes}),
                   **({} if index not in tables else {"block_size": BLOCK_SIZE, "block_table": tables[index]})))
        for index, (key, start, length, digest, enc) in enumerate(placed)
    ]

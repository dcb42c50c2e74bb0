"""DCP plug-ins: our format behind ``torch.distributed.checkpoint``'s StorageWriter/StorageReader.

    dcp.save(state_dict, storage_writer=ckpt.dcp.Writer(path))
    dcp.load(state_dict, storage_reader=ckpt.dcp.Reader(path))

DCP does the distributed part (planning, deduplicating replicated tensors, resharding DTensors);
these classes own the bytes: per-rank data files, checksums, the JSON manifest and the commit
protocol of :mod:`ckpt.commit`. ``Reader.read_metadata`` rebuilds DCP's ``Metadata`` from the
manifest; non-tensor values are decoded from tagged JSON and handed to the planner as objects we
built (re-serialised for planners that insist on a ``torch.save`` stream), so loading never
unpickles anything written into the checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.futures import Future

from . import codec, commit, values
from .chain import ChunkSource, read_manifest
from .datafile import Payload, tensor_bytes, write_file
from .errors import InvalidManifestError, UnsafeCheckpointError
from .fileio import checksum
from .format import Chunk, Manifest, TensorEntry, ValueEntry, data_file_name



def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _is_local_path(checkpoint_id: str | os.PathLike) -> bool:
    return "://" not in str(checkpoint_id)


@dataclass(frozen=True)
class _RankTarget:
    """What the coordinator tells each rank in its plan: where to write and under which rank id."""

    tmp_dir: str
    rank: int


class Writer(StorageWriter):
    """Writes a checkpoint directory in our format; commits it atomically on ``finish``.

    Args:
        path: the checkpoint directory to create (``dcp.save(checkpoint_id=...)`` may set it instead).
        overwrite: replace an existing committed checkpoint at ``path`` (atomically) instead of failing.
        files_per_rank: data files each rank writes in parallel threads (more helps fast NVMe).
        compress: "zstd" stores chunks as zstd-compressed byte planes (codec "planes"); None: raw.
        base: the previous snapshot's state dict (same structure as the saved one); each chunk is
            then stored as a lossless delta against the same chunk in it, and ``base_name`` (the
            base checkpoint's directory, a sibling of ``path``) is recorded. Chunks without a
            matching base chunk are stored whole.
        zstd_level, encode_threads: codec level and encoder threads (default: one per core).
        step, kind, base_step, user_metadata: recorded in the manifest.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        overwrite: bool = False,
        files_per_rank: int = 1,
        step: int | None = None,
        kind: str = "full",
        base_step: int | None = None,
        user_metadata: dict | None = None,
        compress: str | None = None,
        base: dict | None = None,
        base_name: str | None = None,
        zstd_level: int = 1,
        encode_threads: int | None = None,
    ):
        super().__init__()
        if compress not in (None, "zstd"):
            raise ValueError(f"compress must be None or 'zstd', not {compress!r}")
        if (base is None) != (base_name is None):
            raise ValueError("a delta needs both base (the previous snapshot) and base_name")
        self.path = Path(path) if path is not None else None
        self.compress, self.base, self.base_name, self.zstd_level = compress, base, base_name, zstd_level
        self.encode_threads = encode_threads or os.cpu_count() or 1
        self.overwrite = overwrite
        self.files_per_rank = max(1, int(files_per_rank))
        self.step, self.base_step = step, base_step
        self.kind = "delta" if base is not None else kind
        self.user_metadata = dict(user_metadata or {})
        self.tmp_dir: Path | None = None
        self.rank = 0
        self.is_coordinator = True

    # -- DCP protocol ------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.tmp_dir = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise ValueError("Writer needs a path (or dcp.save(checkpoint_id=...))")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.tmp_dir = commit.begin(self.path, overwrite=self.overwrite)
        return [
            dataclasses.replace(plan, storage_data=_RankTarget(str(self.tmp_dir), rank))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        target: _RankTarget = plan.storage_data
        encoder = ChunkEncoder(self.compress, self.base, self.zstd_level)
        pool = ThreadPoolExecutor(self.encode_threads, thread_name_prefix="ckpt-encode") if encoder.active else None
        try:
            results = write_rank(Path(target.tmp_dir), target.rank, plan.items, planner, self.files_per_rank,
                                 encoder if encoder.active else None, pool, window=2 * self.encode_threads)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        manifest = build_manifest(metadata, results)
        manifest.step, manifest.kind, manifest.base_step = self.step, self.kind, self.base_step
        manifest.base = self.base_name
        manifest.user = self.user_metadata
        commit.finish(self.tmp_dir, self.path, manifest.to_json(), overwrite=self.overwrite)
        self.last_manifest = manifest

    def abort(self) -> None:
        """Remove this save's tmp directory after a failure (coordinator only; safe to call twice)."""
        if self.tmp_dir is not None:
            commit.abort(self.tmp_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_local_path(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))


class ChunkEncoder:
    """Turns a chunk's raw bytes into what is stored: a delta against the base snapshot's same
    chunk when there is one, zstd byte planes when compression is on, else the raw bytes."""

    def __init__(self, compress: str | None, base: dict | None, level: int):
        self.compress, self.level = compress, level
        self.base = flatten_state_dict(base)[0] if base is not None else None
        self.active = compress is not None or base is not None

    def __call__(self, item: WriteItem, raw):
        itemsize = item.tensor_data.properties.dtype.itemsize
        previous = self._base_chunk(item)
        if previous is not None:
            return codec.encode_delta(raw, tensor_bytes(previous), itemsize, self.level)
        if self.compress:
            return codec.encode_planes(raw, itemsize, self.level)
        return raw

    def _base_chunk(self, item: WriteItem) -> torch.Tensor | None:
        if self.base is None:
            return None
        try:
            previous = find_state_dict_object(self.base, item.index)
        except (ValueError, KeyError, IndexError, RuntimeError):
            return None
        if not isinstance(previous, torch.Tensor) or previous.dtype != item.tensor_data.properties.dtype or \
                tuple(previous.shape) != tuple(item.tensor_data.chunk.sizes):
            return None
        return previous


def write_rank(
    tmp_dir: Path, rank: int, items: list[WriteItem], planner: SavePlanner, files: int,
    encoder: ChunkEncoder | None = None, encoders: ThreadPoolExecutor | None = None, window: int = 4,
) -> list[WriteResult]:
    """Write this rank's share: non-tensor values inline as JSON, everything else to data files."""
    results: list[WriteResult] = []
    payloads: list[Payload] = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            inline = _json_value(item, planner)
            if inline is not None:
                results.append(WriteResult(item.index, len(json.dumps(inline.value)), inline))
                continue
            payloads.append(Payload(item, lambda item=item: planner.resolve_data(item).getbuffer(), 0))
        else:
            if encoder is None:
                produce = lambda item=item: tensor_bytes(planner.resolve_data(item))  # noqa: E731
            else:
                produce = lambda item=item: encoder(item, tensor_bytes(planner.resolve_data(item)))  # noqa: E731
            payloads.append(Payload(item, produce, item.tensor_storage_size() or 0))
    buckets = _balance(payloads, files)
    with ThreadPoolExecutor(len(buckets), thread_name_prefix="ckpt-write") as writers:
        futures = [
            writers.submit(write_file, tmp_dir / data_file_name(rank, part), data_file_name(rank, part), bucket,
                           encoders=encoders, window=window)
            for part, bucket in enumerate(buckets)
        ]
        for future in futures:
            for item, blob in future.result():
                if item.type == WriteItemType.BYTE_IO:
                    record: Any = ValueEntry("torch_save", blob=blob)
                else:
                    chunk = item.tensor_data.chunk
                    record = Chunk(tuple(chunk.offsets), tuple(chunk.sizes), blob)
                results.append(WriteResult(item.index, blob.length, record))
    return results


def _json_value(item: WriteItem, planner: SavePlanner) -> ValueEntry | None:
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        return None
    try:
        return ValueEntry("json", value=values.encode(lookup(item.index)))
    except values.NotJSONable:
        return None


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


def build_manifest(metadata: Metadata, results: list[list[WriteResult]]) -> Manifest:
    manifest = Manifest(world_size=len(results), created=time.time(), dcp_version=metadata.version)
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            manifest.tensors[key] = TensorEntry(md.properties.dtype, tuple(md.size), [])
    for rank_results in results:
        for result in rank_results:
            record = result.storage_data
            if isinstance(record, Chunk):
                manifest.tensors[result.index.fqn].chunks.append(record)
                blob = record.blob
            else:
                manifest.values[result.index.fqn] = record
                blob = record.blob
            if blob is not None:
                end = blob.offset + blob.length
                manifest.files[blob.file] = max(manifest.files.get(blob.file, 0), end)
    for entry in manifest.tensors.values():
        entry.chunks.sort(key=lambda c: c.offsets)
    if isinstance(metadata.planner_data, dict):
        for key, path in metadata.planner_data.items():
            if isinstance(path, (tuple, list)) and all(type(p) in (str, int) for p in path):
                manifest.paths[key] = tuple(path)
    return manifest


class Reader(StorageReader):
    """Reads a checkpoint written by :class:`Writer`, for any current layout (DCP reshards).

    ``manifest`` may be passed when the caller already read and validated it.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, manifest: Manifest | None = None):
        super().__init__()
        self.path = Path(path) if path is not None else None
        self.manifest = manifest

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
            self.manifest = None

    # No **kwargs: DCP would otherwise retry a failed read as "rank-local metadata" and bury our
    # error under its own AssertionError.
    def read_metadata(self, *args: Any) -> Metadata:
        if self.path is None:
            raise ValueError("Reader needs a path (or dcp.load(checkpoint_id=...))")
        if self.manifest is None:
            self.manifest = read_manifest(self.path)
        return self.manifest.to_dcp_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        by_record: dict[MetadataIndex, list] = defaultdict(list)
        for item in plan.items:
            by_record[item.storage_index].append(item)
        with ChunkSource(self.path, self.manifest) as source:
            for index, items in by_record.items():
                record = self.storage[index]
                if isinstance(record, ValueEntry):
                    value = self._decode_value(index.fqn, record, source.files)
                    for item in items:
                        _deliver_value(planner, item, value)
            chunks = [(index, items) for index, items in by_record.items() if isinstance(self.storage[index], Chunk)]
            chunks.sort(key=lambda c: (self.storage[c[0]].blob.file, self.storage[c[0]].blob.offset))
            self._read_chunks(chunks, planner, source)
        return _done(None)

    def _read_chunks(self, chunks, planner: LoadPlanner, source: ChunkSource) -> None:
        files = source.files
        deferred = []  # (item, target, blob, digest future): hashed while the next chunk is read
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as hasher:
            for index, items in chunks:
                chunk: Chunk = self.storage[index]
                entry = self.manifest.tensors[index.fqn]
                if chunk.blob.codec != codec.RAW:  # compressed or delta: decode (replaying the chain)
                    raw = source.raw(index.fqn, chunk, entry.dtype.itemsize)
                    stored = torch.from_numpy(raw).view(entry.dtype).reshape(chunk.sizes)
                else:
                    direct = _direct_target(planner, items, chunk, entry.dtype)
                    if direct is not None:
                        view = direct.reshape(-1).view(torch.uint8).numpy()
                        files.read_into(chunk.blob, memoryview(view), what=index.fqn)
                        deferred.append((items[0], direct, chunk.blob, hasher.submit(checksum, view)))
                        continue
                    files.check(chunk.blob, what=index.fqn)
                    stored = torch.empty(chunk.sizes, dtype=entry.dtype)
                    view = stored.reshape(-1).view(torch.uint8).numpy()
                    files.read_into(chunk.blob, memoryview(view), what=index.fqn)
                    files.verify(chunk.blob, checksum(view), what=index.fqn)
                for item in items:
                    piece = stored
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        piece = piece.narrow(dim, start, length)
                    target = planner.resolve_tensor(item)
                    target.copy_(piece)
                    planner.commit_tensor(item, target)
            for item, target, blob, digest in deferred:
                files.verify(blob, digest.result(), what=item.dest_index.fqn)
                planner.commit_tensor(item, target)

    def _decode_value(self, key: str, record: ValueEntry, files) -> Any:
        if record.encoding == "json":
            return values.decode(record.value)
        raw = files.read(record.blob, what=key)
        try:
            return torch.load(io.BytesIO(bytes(raw)), weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpointError(
                f"{self.path}: value {key!r} cannot be loaded without executing code from the checkpoint "
                f"({type(exc).__name__}); refused"
            ) from None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _is_local_path(checkpoint_id)


def _direct_target(planner: LoadPlanner, items: list, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor | None:
    """The live tensor itself, when one read item wants the whole stored chunk in the same layout."""
    if len(items) != 1:
        return None
    item = items[0]
    if any(item.storage_offsets) or tuple(item.lengths) != chunk.sizes:
        return None
    target = planner.resolve_tensor(item)
    if target.device.type != "cpu" or target.dtype != dtype or not target.is_contiguous():
        return None
    return target


def _deliver_value(planner: LoadPlanner, item, value: Any) -> None:
    if item.type != LoadItemType.BYTE_IO:
        raise InvalidManifestError(f"{item.dest_index.fqn}: checkpoint holds a value where a tensor is expected")
    load_value = getattr(planner, "load_value", None)
    if load_value is not None:
        load_value(item, value)
        return
    # A foreign planner insists on a torch.save stream: give it one built from our decoded object.
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    planner.load_bytes(item, stream)

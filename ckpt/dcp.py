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
from torch.futures import Future

from . import commit, values
from .datafile import DataFiles, Payload, tensor_bytes, write_file
from .errors import CheckpointNotFoundError, InvalidManifestError, UnsafeCheckpointError, UnsupportedFormatError
from .fileio import checksum
from .format import MANIFEST_NAME, Chunk, Manifest, TensorEntry, ValueEntry, data_file_name

MAX_MANIFEST_BYTES = 1 << 30


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
    ):
        super().__init__()
        self.path = Path(path) if path is not None else None
        self.overwrite = overwrite
        self.files_per_rank = max(1, int(files_per_rank))
        self.step, self.kind, self.base_step = step, kind, base_step
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
        results = write_rank(Path(target.tmp_dir), target.rank, plan.items, planner, self.files_per_rank)
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        manifest = build_manifest(metadata, results)
        manifest.step, manifest.kind, manifest.base_step = self.step, self.kind, self.base_step
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


def write_rank(
    tmp_dir: Path, rank: int, items: list[WriteItem], planner: SavePlanner, files: int
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
            payloads.append(
                Payload(item, lambda item=item: tensor_bytes(planner.resolve_data(item)), item.tensor_storage_size() or 0)
            )
    buckets = _balance(payloads, files)
    with ThreadPoolExecutor(len(buckets), thread_name_prefix="ckpt-write") as pool:
        futures = [
            pool.submit(write_file, tmp_dir / data_file_name(rank, part), data_file_name(rank, part), bucket)
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


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse and validate the manifest of the committed checkpoint at ``path``."""
    path = Path(path)
    if commit.TMP_MARK in path.name or commit.OLD_MARK in path.name:
        raise CheckpointNotFoundError(f"{path} is the leftover of an unfinished save, not a checkpoint")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointNotFoundError(f"{path} is not a committed checkpoint (no {MANIFEST_NAME})")
    if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise InvalidManifestError(f"{manifest_path} is absurdly large", file=MANIFEST_NAME)
    return Manifest.from_json(manifest_path.read_bytes(), source=str(manifest_path))


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
        with DataFiles(self.path) as files:
            for index, items in by_record.items():
                record = self.storage[index]
                if isinstance(record, ValueEntry):
                    value = self._decode_value(index.fqn, record, files)
                    for item in items:
                        _deliver_value(planner, item, value)
            chunks = [(index, items) for index, items in by_record.items() if isinstance(self.storage[index], Chunk)]
            chunks.sort(key=lambda c: (self.storage[c[0]].blob.file, self.storage[c[0]].blob.offset))
            self._read_chunks(chunks, planner, files)
        return _done(None)

    def _read_chunks(self, chunks, planner: LoadPlanner, files: DataFiles) -> None:
        deferred = []  # (item, target, blob, digest future): hashed while the next chunk is read
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as hasher:
            for index, items in chunks:
                chunk: Chunk = self.storage[index]
                entry = self.manifest.tensors[index.fqn]
                if chunk.blob.codec != "raw":
                    raise UnsupportedFormatError(f"{index.fqn}: unknown codec {chunk.blob.codec!r}")
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
                    source = stored
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                        source = source.narrow(dim, start, length)
                    target = planner.resolve_tensor(item)
                    target.copy_(source)
                    planner.commit_tensor(item, target)
            for item, target, blob, digest in deferred:
                files.verify(blob, digest.result(), what=item.dest_index.fqn)
                planner.commit_tensor(item, target)

    def _decode_value(self, key: str, record: ValueEntry, files: DataFiles) -> Any:
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

"""DCP plug-ins: our format behind ``torch.distributed.checkpoint``'s StorageWriter/StorageReader.

    dcp.save(state_dict, storage_writer=ckpt.dcp.Writer(path))
    dcp.load(state_dict, storage_reader=ckpt.dcp.Reader(path))

DCP does the distributed part (planning, deduplicating replicated tensors, resharding DTensors).
This module holds only the protocol objects; the bytes are :mod:`ckpt.write`'s (encode, balance,
data files), the manifest :mod:`ckpt.assemble`'s, the commit :mod:`ckpt.commit`'s (publish) and the
reading :mod:`ckpt.read`'s (read, verify, decode) through :mod:`ckpt.prefetch` (parallel reads of
only the blocks each rank needs). ``Reader.read_metadata`` rebuilds DCP's
``Metadata`` from the manifest; non-tensor values are handed to the planner as objects we decoded
(re-serialised for planners that insist on a ``torch.save`` stream), so loading never unpickles
anything written into the checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import commit
from ._gc import paused_gc
from ._read_assign import Opened, RankShares, assign_shared_reads, one_checkpoint
from ._read_share import Exchange, serve_shared
from .committed import read_manifest
from .delta import DeltaBase
from .errors import CheckpointError, InvalidManifestError, InvalidOptionError
from .format import Chunk, Manifest, ValueEntry, codec
from .options import SaveOptions
from .outcomes import LoadStats
from .prefetch import Want, read_chunks
from .read import ChunkSource
from .storage import Location, locate
from .storage.counting import ReadCounter, counted
from .assemble import build_manifest
from .write import write_rank


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


@dataclass(frozen=True)
class _RankTarget:
    """What the coordinator tells each rank in its plan: where to write (a path on the writer's own
    mount: no storage options travel between ranks), the attempt's tag and the rank id."""

    directory: str
    tag: str
    rank: int


class Writer(StorageWriter):
    """Writes a checkpoint directory in our format; commits it atomically on ``finish``.

    Args:
        path: the checkpoint directory to create, a path or a URL such as ``s3://bucket/run/step-1``
            (``dcp.save(checkpoint_id=...)`` may set it instead).
        overwrite: replace an existing committed checkpoint at ``path`` (atomically) instead of failing.
        step: recorded in the manifest.
        base: a :class:`~ckpt.delta.DeltaBase`: the checkpoint is then a delta, each chunk stored
            against the same chunk of ``base.state`` (chunks without a match are stored whole),
            and ``base.name`` (a sibling of ``path``) is recorded as its base.
        kind: optional check, "full" or "delta"; must agree with ``base``.
        options: a :class:`~ckpt.options.SaveOptions`; the writer uses ``files_per_rank``,
            ``compress``, ``zstd_level``, ``encode_threads`` and ``user_metadata``. Those fields
            may also be given as keyword arguments (``Writer(path, files_per_rank=4)``).
        storage_options: passed to fsspec for a URL (credentials, ``client_kwargs``); never stored.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        overwrite: bool = False,
        step: int | None = None,
        base: DeltaBase | None = None,
        kind: str | None = None,
        options: SaveOptions | None = None,
        storage_options: dict | None = None,
        **option_overrides: Any,
    ):
        super().__init__()
        self.storage_options = storage_options
        self.options = (options or SaveOptions()).replace(**option_overrides)
        if kind is not None and (kind not in ("full", "delta") or (kind == "delta") != (base is not None)):
            raise InvalidOptionError("kind", kind, "must be 'delta' exactly when base=DeltaBase(...) is given")
        if base is not None and not isinstance(base, DeltaBase):
            raise TypeError(f"base must be a ckpt.delta.DeltaBase, not {type(base).__name__}")
        self.path = locate(path, storage_options) if path is not None else None
        if base is not None and (base.step == step or (self.path is not None and base.name == self.path.name)):
            raise InvalidOptionError("base", base.name, f"a delta cannot be its own base (step {base.step})")
        self.overwrite, self.step, self.base = overwrite, step, base
        self.attempt: commit.Attempt | None = None
        self.manifest: Manifest | None = None  # the committed manifest, on the coordinator
        self.before_begin = None  # a check the coordinator runs before anything is written (the manager's)
        self.before_commit = None  # the fence the coordinator runs right before the commit point (the manager's)
        self.run: str | None = None  # the run identity recorded in the manifest (the manager's)

    # -- DCP protocol ------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = locate(checkpoint_id, self.storage_options)
        self.attempt = None
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise ValueError("Writer needs a path (or dcp.save(checkpoint_id=...))")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.before_begin is not None:
            self.before_begin()
        self.attempt = commit.begin(self.path, overwrite=self.overwrite)
        return [
            dataclasses.replace(plan, storage_data=_RankTarget(self.attempt.directory.path, self.attempt.tag, rank))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        target: _RankTarget = plan.storage_data
        directory = Location(self.path.storage, target.directory)
        return _done(write_rank(directory, target.rank, plan.items, planner, self.options, self.base, target.tag))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        manifest = build_manifest(metadata, results, step=self.step, base=self.base, user=self.options.user_metadata,
                                  run=self.run)
        commit.finish(self.attempt, manifest, overwrite=self.overwrite, fence=self.before_commit)
        self.manifest = manifest

    def abort(self) -> None:
        """Remove what this save wrote after a failure (coordinator only; safe to call twice)."""
        if self.attempt is not None:
            commit.abort(self.attempt)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))


class Reader(StorageReader):
    """Reads a checkpoint written by :class:`Writer`, for any current layout (DCP reshards).

    ``path`` is a directory or a URL (``storage_options`` go to fsspec); ``manifest`` may be passed
    when the caller already read and validated it. ``mirrors``: other roots holding copies of the
    links of a delta chain (replicas), tried link by link when a base is missing or damaged.
    ``process_group``: the load's group (the one given to ``dcp.load``); with it, a stored chunk
    that several ranks need whole is read by one of them and sent to the others
    (:mod:`ckpt._read_assign`, :mod:`ckpt._read_share`). ``stats``: this rank's
    :class:`~ckpt.outcomes.LoadStats` (bytes read from storage, received, sent).
    """

    def __init__(self, path: str | os.PathLike | None = None, *, manifest: Manifest | None = None,
                 storage_options: dict | None = None, mirrors: tuple = (), process_group=None):
        super().__init__()
        self.process_group = process_group
        self.stats = LoadStats()
        self.storage_options = storage_options
        self.mirrors = tuple(locate(m, storage_options) for m in mirrors)
        self.path = locate(path, storage_options) if path is not None else None
        self.manifest = manifest
        self._unreadable: CheckpointError | None = None
        self.peer_lost: CheckpointError | None = None  # a rank that died while chunks were exchanged

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = locate(checkpoint_id, self.storage_options)
            self.manifest = None

    # No **kwargs: DCP would otherwise retry a failed read as "rank-local metadata".
    def read_metadata(self, *args: Any) -> Metadata:
        if self.path is None:
            raise ValueError("Reader needs a path (or dcp.load(checkpoint_id=...))")
        if self.manifest is None:
            try:
                self.manifest = read_manifest(self.path)
            except CheckpointError as exc:
                # DCP turns an error raised here into a bare AssertionError carrying only its
                # text; raised from set_up_storage_reader instead, it reaches the caller as itself
                # inside DCP's CheckpointException.
                self._unreadable = exc
                return Metadata(state_dict_metadata={})
        with paused_gc():
            return self.manifest.to_dcp_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._unreadable is not None:
            error, self._unreadable = self._unreadable, None
            raise error
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        opened = Opened(self.manifest.identity(), str(self.path), self.manifest.step, plan.storage_data)
        return dataclasses.replace(plan, storage_data=opened)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        opened = [plan.storage_data for plan in plans]
        plans = [dataclasses.replace(plan, storage_data=o.inner) if isinstance(o, Opened) else plan
                 for plan, o in zip(plans, opened)]
        one_checkpoint(opened)
        if self.process_group is None:
            return plans
        with paused_gc():
            return assign_shared_reads(plans, self.storage)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        counter = ReadCounter()
        try:
            shares = plan.storage_data
            together = shares.together if isinstance(shares, RankShares) else frozenset()
            return self._read_items(self._exchange(plan, planner, counter), planner, counter, together)
        finally:
            self.stats.bytes_read += counter.bytes

    def _exchange(self, plan: LoadPlan, planner: LoadPlanner, counter: ReadCounter) -> list:
        """This rank's part in reading shared chunks once (:mod:`ckpt._read_share`); the items left."""
        if self.process_group is None:
            return list(plan.items)
        exchange = Exchange(self.process_group)
        try:
            with ChunkSource(counted(self.path, counter), self.manifest,
                             mirrors=tuple(counted(m, counter) for m in self.mirrors)) as source:
                return serve_shared(plan, planner, source, self.storage, exchange, self.stats)
        finally:  # a lost peer also breaks DCP's collectives after this: ckpt.load raises it instead
            self.peer_lost = next(iter(exchange.lost.values()), None)

    def _read_items(self, plan_items: list, planner: LoadPlanner, counter: ReadCounter,
                    together: frozenset[str]) -> Future:
        by_record: dict[MetadataIndex, list] = defaultdict(list)
        for item in plan_items:
            by_record[item.storage_index].append(item)
        chunks = []
        with ChunkSource(counted(self.path, counter), self.manifest,
                         mirrors=tuple(counted(m, counter) for m in self.mirrors)) as source:
            for index, items in by_record.items():
                record = self.storage[index]
                if isinstance(record, ValueEntry):
                    value = source.value(index.fqn, record)
                    for item in items:
                        _deliver_value(planner, item, value)
                else:
                    chunks.append((index, items, record))
            chunks.sort(key=self._read_order(chunks))
            for index, _, chunk in chunks:  # every chunk (and its block table) lies inside its file
                source.files.check(chunk.blob, what=index.fqn)
                source.files.check_table(chunk.blob, what=index.fqn)
            read_chunks(source, self._requests(chunks, planner), together=together)
        return _done(None)

    def _read_order(self, chunks):
        """Each file's chunks by offset, each rank starting at another file (its place in the
        group): ranks that need the same files (read side by side, :func:`ckpt.prefetch.read_chunks`)
        pull different ones from storage at a time, and each finds the others' windows in the page
        cache a moment later."""
        files = sorted({chunk.blob.file for _, _, chunk in chunks})
        shift = 0
        if self.process_group is not None and files:
            shift = dist.get_rank(self.process_group) % len(files)
        place = {name: (i - shift) % len(files) for i, name in enumerate(files)}
        return lambda c: (place[c[2].blob.file], c[2].blob.offset)

    def _requests(self, chunks, planner: LoadPlanner):
        """What :func:`ckpt.prefetch.read_chunks` loads: each chunk with the boxes of it the plan's
        items want (into ``planner.resolve_tensor``, committed with ``planner.commit_tensor``)."""
        for index, items, chunk in chunks:
            direct = None
            if chunk.blob.codec == codec.RAW:
                direct = _direct_target(planner, items, chunk, self.manifest.tensors[index.fqn].dtype)
            wants = [Want(tuple(item.storage_offsets), tuple(item.lengths),
                          lambda item=item: planner.resolve_tensor(item),
                          lambda tensor, item=item: planner.commit_tensor(item, tensor)) for item in items]
            yield index.fqn, chunk, wants, direct

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


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

"""DCP's StorageReader for our format: the protocol object of a load, nothing more.

    dcp.load(state_dict, storage_reader=ckpt.dcp.Reader(path))

``read_metadata`` rebuilds DCP's ``Metadata`` from the manifest (:mod:`ckpt.read.committed`);
``prepare_global_plan`` decides which rank reads a chunk several ranks need whole
(:mod:`ckpt.read.assignment`); ``read_data`` takes part in that exchange (:mod:`ckpt.read.exchange`)
and reads the rest (:mod:`ckpt.read.items`: read order, direct targets, values). Non-tensor values
are handed to the planner as objects we decoded, so loading never unpickles anything written into
the checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointError
from ..format import Manifest
from ..outcomes import LoadStats
from ..storage import Location, locate
from ..storage.counting import ReadCounter, counted
from .assignment import Opened, RankShares, assign_shared_reads, one_checkpoint
from .committed import read_manifest
from .exchange import Exchange, serve_shared
from .gc_pause import paused_gc
from .items import read_items
from .source import ChunkSource


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class Reader(StorageReader):
    """Reads a checkpoint written by :class:`Writer`, for any current layout (DCP reshards).

    ``path`` is a directory or a URL (``storage_options`` go to fsspec); ``manifest`` may be passed
    when the caller already read and validated it. ``mirrors``: other roots holding copies of the
    links of a delta chain (replicas), tried link by link when a base is missing or damaged.
    ``process_group``: the load's group (the one given to ``dcp.load``); with it, a stored chunk
    that several ranks need whole is read by one of them and sent to the others
    (:mod:`ckpt.read.assignment`, :mod:`ckpt.read.exchange`). ``stats``: this rank's
    :class:`~ckpt.outcomes.LoadStats` (bytes read from storage, received, sent).
    """

    def __init__(self, path: str | os.PathLike | Location | None = None, *, manifest: Manifest | None = None,
                 storage_options: dict | None = None, mirrors: tuple = (), process_group=None):
        super().__init__()
        self.process_group = process_group
        self.stats = LoadStats()
        self.storage_options = storage_options
        self.mirrors = tuple(locate(m, self.storage_options) for m in mirrors)
        self.path = locate(path, self.storage_options) if path is not None else None
        self.manifest = manifest
        self._unreadable: CheckpointError | None = None
        self.peer_lost: CheckpointError | None = None  # a rank that died while chunks were exchanged

    def reset(self, checkpoint_id: str | os.PathLike | Location | None = None) -> None:
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
            items = self._exchange(plan, planner, counter)
            rank = dist.get_rank(self.process_group) if self.process_group is not None else 0
            with ChunkSource(counted(self.path, counter), self.manifest,
                             mirrors=tuple(counted(m, counter) for m in self.mirrors)) as source:
                read_items(source, self.manifest, self.storage, items, planner, rank=rank, together=together)
            return _done(None)
        finally:
            self.stats.bytes_read += counter.bytes

    def _exchange(self, plan: LoadPlan, planner: LoadPlanner, counter: ReadCounter) -> list:
        """This rank's part in reading shared chunks once (:mod:`ckpt.read.exchange`); the items left."""
        if self.process_group is None:
            return list(plan.items)
        exchange = Exchange(self.process_group)
        try:
            return serve_shared(plan, planner, lambda: ChunkSource(counted(self.path, counter), self.manifest,
                                                                   mirrors=tuple(counted(m, counter) for m in self.mirrors)),
                                self.storage, exchange, self.stats)
        finally:  # a lost peer also breaks DCP's collectives after this: ckpt.load raises it instead
            self.peer_lost = next(iter(exchange.lost.values()), None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

"""Replicated bytes read once, the decision: which rank reads each stored chunk that several ranks
need whole, made by DCP's coordinator over every rank's load plan (``prepare_global_plan``).

A stored chunk is *shared* when two or more ranks of the load each have a read item covering all
of it (DDP replicas, the replicate dimension of HSDP, a plain tensor every rank holds, a same-layout
tensor replicated over part of the mesh). One of those ranks reads it from storage and sends it to
the others (:mod:`ckpt._read_share`); a rank that needs only part of a chunk (a resharded load)
reads its part itself. The readers are spread: shared chunks are taken largest first, each by the
rank among its takers with the fewest bytes assigned so far (ties: the lowest rank), so replicas
split the reading rather than leaving it on rank 0.

Each rank gets, in its plan's ``storage_data``, a :class:`RankShares`: its own exchanges in the one
global order every rank follows (sorted by the global position ``op``), so every pair of ranks
meets at each exchange in the same order and none waits on a peer that waits on it (the lowest
unfinished exchange always has both ends at it). The work is linear in the plans' items.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from .format import Chunk


@dataclass(frozen=True)
class SharedRead:
    """One exchange: ``reader`` reads the chunk at ``index`` from storage and sends it to each of
    ``receivers`` (ranks of the load's process group); ``op`` is its place in the global order."""

    op: int
    index: MetadataIndex
    reader: int
    receivers: tuple[int, ...]


@dataclass
class RankShares:
    """One rank's part in the exchange, in the global order."""

    ops: list[SharedRead] = field(default_factory=list)
    inner: Any = None  # the plan's storage_data before (none of ours: kept for whoever set it)

    def indices(self) -> set[MetadataIndex]:
        """The stored chunks this rank gets through the exchange (read for others, or received)."""
        return {op.index for op in self.ops}


def covers_whole(item: ReadItem, chunk: Chunk) -> bool:
    """Whether ``item`` asks for every element of the stored ``chunk``."""
    return (item.type == LoadItemType.TENSOR and not any(item.storage_offsets)
            and tuple(item.lengths) == tuple(chunk.sizes))


def assign_shared_reads(plans: list[LoadPlan], storage: dict) -> list[LoadPlan]:
    """``plans`` with a :class:`RankShares` in each ``storage_data`` that takes part in an exchange."""
    takers: dict[MetadataIndex, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            chunk = storage.get(item.storage_index)
            if not isinstance(chunk, Chunk) or not chunk.blob.decoded_length or not covers_whole(item, chunk):
                continue
            ranks = takers.setdefault(item.storage_index, [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    shared = sorted(((index, ranks) for index, ranks in takers.items() if len(ranks) > 1),
                    key=lambda pair: (-storage[pair[0]].blob.length, pair[0].fqn, tuple(pair[0].offset)))
    if not shared:
        return plans
    assigned = [0] * len(plans)
    per_rank: list[list[SharedRead]] = [[] for _ in plans]
    for op, (index, ranks) in enumerate(shared):
        reader = min(ranks, key=lambda r: (assigned[r], r))
        assigned[reader] += storage[index].blob.length
        exchange = SharedRead(op, index, reader, tuple(r for r in ranks if r != reader))
        for rank in ranks:
            per_rank[rank].append(exchange)
    return [dataclasses.replace(plan, storage_data=RankShares(ops, plan.storage_data)) if ops else plan
            for plan, ops in zip(plans, per_rank)]

"""Replicated bytes read once, the decision: which rank reads each stored chunk that several ranks
need whole, made by DCP's coordinator over every rank's load plan (``prepare_global_plan``).

A stored chunk is *shared* when two or more ranks of the load each have a read item covering all
of it (DDP replicas, the replicate dimension of HSDP, a plain tensor every rank holds, a same-layout
tensor replicated over part of the mesh). One of those ranks reads it from storage and sends it to
the others (:mod:`ckpt.read.exchange`); a rank that needs only part of a chunk (a resharded load)
reads its part itself. The readers are spread: shared chunks are taken largest first, each by the
rank among its takers with the fewest bytes assigned so far (ties: the lowest rank), so replicas
split the reading rather than leaving it on rank 0. Chunks smaller than ``SMALL_BYTES`` (an
optimizer's step counters, norms, biases) go in batches instead, one per set of takers and at most
``BATCH_BYTES`` each: one reader reads them all and sends them as one message, since a message
round trip costs more than the bytes of a small chunk (39 step counters of a 4-rank resume took
50 ms of exchanges one by one on the benchmark box).

Each rank gets, in its plan's ``storage_data``, a :class:`RankShares`: its own exchanges in the one
global order every rank follows (sorted by the global position ``op``), so every pair of ranks
meets at each exchange in the same order and none waits on a peer that waits on it (the lowest
unfinished exchange always has both ends at it); and the data files it reads in part that other
ranks read too (``together``: Shard(0) → Shard(1), where every rank needs some of every block),
which it reads side by side (:func:`ckpt.read.prefetch.read_chunks`) when there are two or more. The
work is linear in the plans' items.

Before any of that the coordinator checks that every rank opened the same checkpoint (each plan
carries an :class:`Opened`: the digest of the manifest its rank read): ranks given different paths,
or reading a step another process replaced in between, would each load their own checkpoint's
chunks into one state; :func:`one_checkpoint` fails such a load on every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ..errors import CheckpointError
from ..format import Chunk


SMALL_BYTES = 1 << 20  # shared chunks below this travel in batches
BATCH_BYTES = 16 << 20  # stored bytes of one batch, at most (what a receiver stages)


@dataclass(frozen=True)
class SharedRead:
    """One exchange: ``reader`` reads the chunks at ``indices`` (one, or a batch of small ones) from
    storage and sends them to each of ``receivers`` (ranks of the load's process group) as one
    message; ``op`` is its place in the global order."""

    op: int
    indices: tuple[MetadataIndex, ...]
    reader: int
    receivers: tuple[int, ...]


@dataclass
class RankShares:
    """One rank's part in the exchange, in the global order."""

    ops: list[SharedRead] = field(default_factory=list)
    inner: Any = None  # the plan's storage_data before (none of ours: kept for whoever set it)
    together: frozenset[str] = frozenset()  # data files this rank reads itself that other ranks read too

    def indices(self) -> set[MetadataIndex]:
        """The stored chunks this rank gets through the exchange (read for others, or received)."""
        return {index for op in self.ops for index in op.indices}


@dataclass(frozen=True)
class Opened:
    """The checkpoint a rank opened, in its local plan: its manifest's digest, path and step."""

    identity: str
    path: str
    step: int | None
    inner: Any  # the plan's storage_data before (kept for whoever set it)


def one_checkpoint(opened: list) -> None:
    """Refuse a load whose ranks opened different checkpoints (rank-dependent paths, a step
    committed between two ranks' reads): each would load its own chunks into one state."""
    seen: dict[str, tuple[int, Opened]] = {}
    for rank, o in enumerate(opened):
        if isinstance(o, Opened):
            seen.setdefault(o.identity, (rank, o))
    if len(seen) > 1:
        which = "; ".join(f"rank {rank}: {o.path} (step {o.step}, manifest digest {o.identity})"
                          for rank, o in seen.values())
        raise CheckpointError(f"the ranks of one load opened different checkpoints ({which}); "
                              "every rank must load the same checkpoint - nothing was loaded")


def covers_whole(item: ReadItem, chunk: Chunk) -> bool:
    """Whether ``item`` asks for every element of the stored ``chunk``."""
    return (item.type == LoadItemType.TENSOR and not any(item.storage_offsets)
            and tuple(item.lengths) == tuple(chunk.sizes))


def assign_shared_reads(plans: list[LoadPlan], storage: dict) -> list[LoadPlan]:
    """``plans`` with a :class:`RankShares` in each ``storage_data`` that takes part in an exchange
    or reads two or more files that other ranks read too."""
    takers: dict[MetadataIndex, list[int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            chunk = storage.get(item.storage_index)
            if not isinstance(chunk, Chunk) or not chunk.blob.decoded_length or not covers_whole(item, chunk):
                continue
            ranks = takers.setdefault(item.storage_index, [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    shared = sorted(((index, tuple(ranks)) for index, ranks in takers.items() if len(ranks) > 1),
                    key=lambda pair: (-storage[pair[0]].blob.length, pair[0].fqn, tuple(pair[0].offset)))
    together = _files_read_together(plans, storage, dict(shared))
    assigned = [0] * len(plans)
    exchanges: list[tuple[list[MetadataIndex], int, tuple[int, ...]]] = []
    batches: dict[tuple[int, ...], tuple[int, int]] = {}  # takers -> (its open batch in exchanges, bytes)
    for index, ranks in shared:
        length = storage[index].blob.length
        small = length < SMALL_BYTES
        at, held = batches.get(ranks, (None, 0)) if small else (None, 0)
        if at is not None and held + length <= BATCH_BYTES:
            reader = exchanges[at][1]
            exchanges[at][0].append(index)
            batches[ranks] = (at, held + length)
        else:
            reader = min(ranks, key=lambda r: (assigned[r], r))
            exchanges.append(([index], reader, ranks))
            if small:
                batches[ranks] = (len(exchanges) - 1, length)
        assigned[reader] += length
    per_rank: list[list[SharedRead]] = [[] for _ in plans]
    for op, (indices, reader, ranks) in enumerate(exchanges):
        exchange = SharedRead(op, tuple(indices), reader, tuple(r for r in ranks if r != reader))
        for rank in ranks:
            per_rank[rank].append(exchange)
    return [dataclasses.replace(plan, storage_data=RankShares(ops, plan.storage_data, files)) if ops or files else plan
            for plan, ops, files in zip(plans, per_rank, together)]


def _files_read_together(plans: list[LoadPlan], storage: dict, exchanged: dict) -> list[frozenset[str]]:
    """Per rank, the data files it reads itself (items the exchange, ``exchanged``: chunk -> its
    takers, does not bring) that other ranks read too, when there are two or more of them (one file
    is read in its order either way)."""
    files_of: list[set[str]] = [set() for _ in plans]
    readers: dict[str, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            chunk = storage.get(item.storage_index)
            if (isinstance(chunk, Chunk) and rank not in exchanged.get(item.storage_index, ())
                    and chunk.blob.file not in files_of[rank]):
                files_of[rank].add(chunk.blob.file)
                readers[chunk.blob.file] = readers.get(chunk.blob.file, 0) + 1
    common = [frozenset(name for name in files if readers[name] > 1) for files in files_of]
    return [files if len(files) > 1 else frozenset() for files in common]


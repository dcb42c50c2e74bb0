"""One rank's load plan with the saved chunks indexed: cost linear in what the rank loads and in
the checkpoint's size, never in their product (pytorch#169113).

DCP's ``create_default_local_load_plan`` matches every local chunk of a tensor against its saved
chunks with a sweep line whose active set holds every saved chunk that began before the local chunk
ends; for a tensor sharded along a dimension shorter than another (a column shard of a tall matrix),
every saved chunk starts at 0 on the sweep dimension, the active set is all of them, and each rank
inserts and scans all of them (O(saved²) inserts, O(local × saved) tests).

:class:`SavedChunks` indexes one tensor's saved chunks once, sorted by their start on the dimension
that tells them apart best (the most distinct starts); a query for a local box bisects to the saved
chunks that can reach it (start in ``(lo - longest, hi)``) and tests only those. A same-layout
load tests one saved chunk per local chunk, whatever the world size. :func:`local_load_plan` builds
the same read items as DCP's (same fields; local chunks in their own order, saved chunks in
storage order) and counts the overlap tests it made (``checks``), so a test can prove the shape
without a clock.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_chunk_list,
    _create_read_item_for_byteio,
    _create_read_item_for_tensor,
)
from torch.distributed.tensor import DTensor


class SavedChunks:
    """The saved chunks of one tensor, indexed for box queries (see the module docstring)."""

    def __init__(self, chunks: list[ChunkStorageMetadata]):
        self.chunks = chunks
        ndims = len(chunks[0].offsets) if chunks else 0
        self.dim = max(range(ndims), key=lambda d: len({c.offsets[d] for c in chunks})) if ndims else None
        if self.dim is None:
            self.order = list(range(len(chunks)))
            self.starts = [0] * len(chunks)
            self.longest = 1
        else:
            d = self.dim
            self.order = sorted(range(len(chunks)), key=lambda i: chunks[i].offsets[d])
            self.starts = [chunks[i].offsets[d] for i in self.order]
            self.longest = max((c.sizes[d] for c in chunks), default=0)
        self.checks = 0  # overlap tests made by queries

    def overlapping(self, box: ChunkStorageMetadata) -> list[int]:
        """Indices (in storage order) of the saved chunks that share an element with ``box``."""
        if self.dim is None:
            lo, hi = 0, len(self.order)
        else:
            start, size = box.offsets[self.dim], box.sizes[self.dim]
            lo = bisect_left(self.starts, start - self.longest + 1)
            hi = bisect_left(self.starts, start + size)
        found = []
        for position in range(lo, hi):
            index = self.order[position]
            self.checks += 1
            if _overlap(self.chunks[index], box):
                found.append(index)
        found.sort()
        return found


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    for a_off, a_size, b_off, b_size in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        if a_off >= b_off + b_size or b_off >= a_off + a_size:
            return False
    return True


def tensor_read_items(fqn: str, saved: SavedChunks, local_chunks: list[ChunkStorageMetadata]) -> list[ReadItem]:
    """The read items that fill ``local_chunks`` of ``fqn`` from its saved chunks."""
    items = []
    for local_index, local in enumerate(local_chunks):
        for storage_index in saved.overlapping(local):
            stored = saved.chunks[storage_index]
            storage_offsets, dest_offsets, lengths = [], [], []
            for s_off, l_off, s_size, l_size in zip(stored.offsets, local.offsets, stored.sizes, local.sizes):
                lengths.append(min(s_off + s_size, l_off + l_size) - max(s_off, l_off))
                storage_offsets.append(max(l_off - s_off, 0))
                dest_offsets.append(max(s_off - l_off, 0))
            items.append(_create_read_item_for_tensor(
                dest_index=MetadataIndex(fqn, local.offsets, local_index), dest_offsets=dest_offsets,
                storage_index=MetadataIndex(fqn, stored.offsets, storage_index), storage_offsets=storage_offsets,
                lengths=lengths))
    return items


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> tuple[LoadPlan, int]:
    """DCP's ``create_default_local_load_plan`` over indexed saved chunks; also the overlap tests made."""
    items: list[ReadItem] = []
    checks = 0
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            if strict:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            continue
        if isinstance(md, TensorStorageMetadata) and getattr(obj, "size", None) is not None and md.size != obj.size():
            raise ValueError(f"Size mismatch between saved {md.size} and current: {obj.size()} for {fqn}")
        if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
            continue  # this rank is not in the tensor's mesh
        if isinstance(md, BytesStorageMetadata):
            items.append(_create_read_item_for_byteio(dest_index=MetadataIndex(fqn), dest_offset=0,
                                                      storage_index=MetadataIndex(fqn), storage_offset=0, length=0))
            continue
        try:
            local_chunks = _create_chunk_list(obj)
        except ValueError as exc:
            raise ValueError(f"Invalid checkpoint metadata for {fqn}, expected BytesStorageMetadata but found "
                             f"{type(md)}") from exc
        saved = SavedChunks(md.chunks)
        items.extend(tensor_read_items(fqn, saved, local_chunks))
        checks += saved.checks
    return LoadPlan(items), checks

"""A rank's load plan read: its items grouped by stored record, values delivered, chunks in read order,
each into the live tensor when one item wants it whole (a direct target) or through the planner.

The order: each file's chunks by offset, each rank starting at another file (its place in the
load's group), so ranks that need the same files (read side by side, :func:`ckpt.read.prefetch.read_chunks`)
pull different ones from storage at a time and find the others' windows in the page cache a moment
later. Every chunk and its block table are checked to lie inside their file before a byte is read.
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner

from ..errors import InvalidManifestError
from ..format import Chunk, Manifest, ValueEntry, codec
from .prefetch import Want, read_chunks
from .source import ChunkSource


def read_items(source: ChunkSource, manifest: Manifest, storage: dict, plan_items: list, planner: LoadPlanner, *,
               rank: int = 0, together: frozenset[str] = frozenset()) -> None:
    """Load ``plan_items`` from ``source`` into ``planner``'s state; ``storage`` maps each item's
    storage index to its record (DCP's ``metadata.storage_data``); ``rank``: this rank's place in
    the load's group (where its walk over the files starts)."""
    by_record: dict[MetadataIndex, list] = defaultdict(list)
    for item in plan_items:
        by_record[item.storage_index].append(item)
    chunks = []
    for index, items in by_record.items():
        record = storage[index]
        if isinstance(record, ValueEntry):
            value = source.value(index.fqn, record)
            for item in items:
                _deliver_value(planner, item, value)
        else:
            chunks.append((index, items, record))
    chunks.sort(key=_read_order(chunks, rank))
    for index, _, chunk in chunks:  # every chunk (and its block table) lies inside its file
        source.files.check(chunk.blob, what=index.fqn)
        source.files.check_table(chunk.blob, what=index.fqn)
    read_chunks(source, _requests(chunks, planner, manifest), together=together)


def _read_order(chunks: list, rank: int):
    files = sorted({chunk.blob.file for _, _, chunk in chunks})
    shift = rank % len(files) if files else 0
    place = {name: (i - shift) % len(files) for i, name in enumerate(files)}
    return lambda c: (place[c[2].blob.file], c[2].blob.offset)


def _requests(chunks: list, planner: LoadPlanner, manifest: Manifest) -> Iterator[tuple]:
    """What :func:`ckpt.read.prefetch.read_chunks` loads: each chunk with the boxes of it the plan's
    items want (into ``planner.resolve_tensor``, committed with ``planner.commit_tensor``)."""
    for index, items, chunk in chunks:
        direct = None
        if chunk.blob.codec == codec.RAW:
            direct = _direct_target(planner, items, chunk, manifest.tensors[index.fqn].dtype)
        wants = [Want(tuple(item.storage_offsets), tuple(item.lengths),
                      lambda item=item: planner.resolve_tensor(item),
                      lambda tensor, item=item: planner.commit_tensor(item, tensor)) for item in items]
        yield index.fqn, chunk, wants, direct


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

"""Hostile DCP checkpoints built from a small valid one (:func:`tests.support.dcp_sources.save_small`):
rewritten metadata, replaced items, hand-made zstd bombs. Each builder edits a copy in place."""

from __future__ import annotations

import io
import os
import pickle
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt.convert import read_dcp_metadata


def metadata_of(source: Path) -> Metadata:
    return read_dcp_metadata(source)


def write_metadata(source: Path, metadata: Metadata) -> None:
    (source / ".metadata").write_bytes(pickle.dumps(metadata, protocol=2))


def torch_save_bytes(value, *, recursion: int | None = None) -> bytes:
    limit = sys.getrecursionlimit()
    if recursion is not None:
        sys.setrecursionlimit(recursion)
    try:
        stream = io.BytesIO()
        torch.save(value, stream)
        return stream.getvalue()
    finally:
        sys.setrecursionlimit(limit)


def replace_item(source: Path, key: str, data: bytes, *, file: str = "__9_0.distcp",
                 transforms: list[str] | None = None) -> None:
    """Store ``key``'s (only) item as ``data`` in a new data file ``file``."""
    metadata = metadata_of(source)
    (source / file).write_bytes(data)
    for index, info in metadata.storage_data.items():
        if index.fqn == key:
            info.relative_path, info.offset, info.length = file, 0, len(data)
            info.transform_descriptors = transforms
    write_metadata(source, metadata)


def add_tensor(source: Path, key: str, size: tuple[int, ...], *, file: str, length: int, dtype=torch.float32,
               transforms: list[str] | None = None) -> None:
    """Declare a one-chunk tensor ``key`` of ``size`` stored as bytes 0..length of ``file``."""
    metadata = metadata_of(source)
    shape = torch.Size(size)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=shape)
    metadata.state_dict_metadata[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), shape, [chunk])
    metadata.storage_data[MetadataIndex(key, torch.Size([0] * len(size)))] = _StorageInfo(file, 0, length, transforms)
    write_metadata(source, metadata)


def zstd_rle_bomb(nbytes: int, *, declared: int | None = None) -> bytes:
    """A zstd frame of RLE blocks (4 bytes per 128 KiB) decompressing to ``nbytes`` zeros; its header
    declares ``declared`` bytes of content when given (the content size field)."""
    block = 1 << 17
    blocks, rest = divmod(nbytes, block)
    sizes = [block] * blocks + ([rest] if rest else [])
    if declared is None:
        header = b"\x28\xb5\x2f\xfd" + bytes([0x00, 7 << 3])  # no content size; window 2^17
    else:
        header = b"\x28\xb5\x2f\xfd" + bytes([0xC0, 7 << 3]) + declared.to_bytes(8, "little")
    out = bytearray(header)
    for i, size in enumerate(sizes):
        last = i == len(sizes) - 1
        out += (int(last) | (1 << 1) | (size << 3)).to_bytes(3, "little") + b"\x00"
    return bytes(out)


def sparse_file(path: Path, size: int, head: bytes = b"") -> None:
    """A sparse file of ``size`` bytes (no blocks allocated), starting with ``head``."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def memo_dag(levels: int) -> list:
    """A list of 2**levels leaves built from ``levels`` memo-shared lists (a few bytes pickled)."""
    node: list = ["leaf"]
    for _ in range(levels):
        node = [node, node]
    return node


def deep_list(depth: int) -> list:
    node: list = []
    for _ in range(depth):
        node = [node]
    return node


def shared_chunk_lists(source: Path, tensors: int, chunks: int) -> None:
    """``tensors`` keys of ``chunks`` one-element chunks each, all sharing one memoised chunk list."""
    metadata = metadata_of(source)
    shared = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(chunks)]
    for t in range(tensors):
        metadata.state_dict_metadata[f"t{t}"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                      torch.Size([chunks]), shared)
    write_metadata(source, metadata)


def rename_key(source: Path, old: str, new: str) -> None:
    metadata = metadata_of(source)
    metadata.state_dict_metadata = {new if k == old else k: v for k, v in metadata.state_dict_metadata.items()}
    metadata.storage_data = {MetadataIndex(new if i.fqn == old else i.fqn, i.offset, i.index): v
                             for i, v in metadata.storage_data.items()}
    if isinstance(metadata.planner_data, dict) and old in metadata.planner_data:
        metadata.planner_data[new] = (new,)
        del metadata.planner_data[old]
    write_metadata(source, metadata)


def rename_data_file(source: Path, old: str, new: str) -> None:
    metadata = metadata_of(source)
    os.replace(source / old, source / new)
    for info in metadata.storage_data.values():
        if info.relative_path == old:
            info.relative_path = new
    write_metadata(source, metadata)

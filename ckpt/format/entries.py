"""The manifest's vocabulary (format version 3, docs/FORMAT.md): the format's name and versions, the
kinds of checkpoint, the limits no real checkpoint reaches, the dtypes a tensor may have, and the
entries a manifest lists — :class:`TensorEntry` (its :class:`Chunk` boxes) and :class:`ValueEntry`,
each stored run of bytes a :class:`Blob`.

Plain data: nothing here reads, writes or checks; :mod:`ckpt.format.validate` builds these from a
manifest's JSON and :mod:`ckpt.format.manifest` assembles and serialises them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedFormatError

FORMAT_NAME = "ckpt"
FORMAT_VERSION = 3
# 1: no manifest digest (read as is); 2: every manifest byte digested; 3: blobs longer than a block
# carry per-block checksums (ckpt.format.blocks)
READABLE_VERSIONS = (1, 2, 3)
KINDS = ("full", "delta")

# Upper bounds that no real checkpoint reaches; a manifest beyond them is hostile or broken.
MAX_BYTES = 1 << 50  # 1 PiB in one file or one chunk
MAX_DIMS = 64

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedFormatError(f"dtype {dtype} cannot be stored") from None


@dataclass(frozen=True)
class Blob:
    """Where a run of stored bytes lives and how to verify and decode it."""

    file: str
    offset: int
    length: int  # bytes stored in the file
    checksum: str  # xxh3-64 of the stored bytes (of the block table, with blocks), 16 hex digits
    codec: str = "raw"
    raw_length: int | None = None  # bytes after decoding; equals length for "raw"
    planes: tuple[tuple[str, int], ...] | None = None  # codecs "planes"/"delta": [plane codec, length]
    block_size: int | None = None  # version 3: per-block checksums of this many stored bytes each
    block_table: int | None = None  # where the block table lies in the same file (ckpt.format.blocks)

    @property
    def decoded_length(self) -> int:
        return self.length if self.raw_length is None else self.raw_length

    @property
    def end(self) -> int:
        """The end of what the blob occupies in its file: its bytes, and its block table if any."""
        if self.block_size is None:
            return self.offset + self.length
        table_end = self.block_table + -(-self.length // self.block_size) * 8
        return max(self.offset + self.length, table_end)


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: global ``offsets`` and ``sizes``, bytes in ``blob``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    blob: Blob


@dataclass
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[Chunk]


@dataclass
class ValueEntry:
    """A non-tensor value: inline tagged JSON, or a ``torch.save`` stream read with weights_only."""

    encoding: str  # "json" | "torch_save"
    value: Any = None  # the tagged-JSON form, for "json"
    blob: Blob | None = None  # for "torch_save"

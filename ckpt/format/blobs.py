"""Where a blob goes in a data file and how it is checked: the xxh3-64 checksum every blob carries
(16 hex digits in the manifest) and the 4 KiB alignment of large chunks (see docs/FORMAT.md)."""

from __future__ import annotations

import re
from typing import Any

import xxhash

CHECKSUM_ALGORITHM = "xxh3-64"
ALIGN = 4096
# Chunks at least this big start on a 4 KiB boundary so mmap/O_DIRECT readers can serve them
# alone; smaller ones are packed to avoid wasting a page per norm weight.
ALIGN_MIN_BYTES = 64 << 10

_CHECKSUM = re.compile(r"^[0-9a-f]{16}$")


def checksum(buffer) -> str:
    """xxh3-64 of a bytes-like object as 16 hex digits (releases the GIL on large inputs)."""
    return f"{xxhash.xxh3_64_intdigest(buffer):016x}"


def is_checksum(text: Any) -> bool:
    """Whether ``text`` is a checksum as the manifest writes one (16 lower-case hex digits)."""
    return isinstance(text, str) and _CHECKSUM.fullmatch(text) is not None


def aligned(offset: int, length: int) -> int:
    """Where a chunk of ``length`` bytes written at or after ``offset`` should start."""
    if length < ALIGN_MIN_BYTES:
        return offset
    return (offset + ALIGN - 1) // ALIGN * ALIGN

"""Per-block checksums of a blob (format version 3, docs/FORMAT.md "Blocks").

A blob longer than one block is checked block by block: its stored bytes are cut into blocks of
``block_size`` bytes (the last one shorter), each block's xxh3-64 goes as 8 little-endian bytes into
the blob's *block table*, and the blob's ``checksum`` in the manifest is the xxh3-64 of that table.
The table lives in the data file (after the file's last blob, at the offset ``block_table``), not in
the manifest, so the manifest grows by two numbers per chunk however large the chunk is.

* a whole read hashes each block, builds the table from those hashes and compares its digest with
  the manifest's (:func:`blob_digest`): no table read, one hashing pass, as with version 2;
* a partial read fetches the table (``8 × blocks`` bytes), checks it against the manifest's
  digest, then reads only the blocks that cover the wanted bytes and checks each against its entry
  (:func:`block_span`, :func:`check_blocks`).

A blob without ``block_size`` (version 1 and 2, and any blob of one block or less) keeps the
whole-blob checksum: its ``checksum`` is the xxh3-64 of its stored bytes. Blocks are over the
*stored* bytes, whatever the codec: a compressed or delta chunk is verified block by block too, but
it decodes only whole, so it is always read whole.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np
import xxhash

BLOCK_SIZE = 1 << 20  # what the writer uses: 1 MiB (8 table bytes per MiB stored, 8 KiB per GiB)
MIN_BLOCK_SIZE = 64 << 10  # what a reader accepts: powers of two in [64 KiB, 64 MiB]
MAX_BLOCK_SIZE = 64 << 20
ENTRY_BYTES = 8


def is_block_size(value) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and MIN_BLOCK_SIZE <= value <= MAX_BLOCK_SIZE
            and value & (value - 1) == 0)


def block_count(length: int, block_size: int) -> int:
    return -(-length // block_size)


def table_bytes(length: int, block_size: int) -> int:
    """Size of the block table of a blob of ``length`` stored bytes."""
    return block_count(length, block_size) * ENTRY_BYTES


def block_hashes(buffer, block_size: int) -> list[int]:
    """xxh3-64 of each block of ``buffer`` (which starts on a block boundary)."""
    view = memoryview(buffer).cast("B")
    return [xxhash.xxh3_64_intdigest(view[i: i + block_size]) for i in range(0, len(view), block_size)]


def pack(hashes: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def digest_of_table(table) -> str:
    return f"{xxhash.xxh3_64_intdigest(table):016x}"


def hash_blob(buffer, block_size: int | None) -> tuple[str, bytes | None]:
    """``(checksum, table)`` of a blob's stored bytes as the writer records them: with blocks when
    ``block_size`` is given and the blob is longer than one block, else the whole-blob xxh3-64
    (table None)."""
    view = memoryview(buffer).cast("B")
    if block_size is None or len(view) <= block_size:
        return f"{xxhash.xxh3_64_intdigest(view):016x}", None
    table = pack(block_hashes(view, block_size))
    return digest_of_table(table), table


def blob_digest(buffer, block_size: int | None) -> str:
    """The checksum of a whole blob's stored bytes, to compare with the manifest's."""
    return hash_blob(buffer, block_size)[0]


class StreamDigest:
    """A blob's checksum computed over its bytes as they stream past in pieces of any size (a copy):
    ``update(piece)`` in order, then :meth:`hexdigest` — the same as :func:`blob_digest` of the whole."""

    def __init__(self, block_size: int | None):
        self.block_size, self.hashes = block_size, []
        self._block, self._filled = xxhash.xxh3_64(), 0

    def update(self, piece) -> None:
        view = memoryview(piece).cast("B")
        if self.block_size is None:
            self._block.update(view)
            return
        while len(view):
            take = min(len(view), self.block_size - self._filled)
            self._block.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.block_size:
                self.hashes.append(self._block.intdigest())
                self._block, self._filled = xxhash.xxh3_64(), 0

    def blocks(self) -> list[int]:
        """The hash of each block streamed so far, the last one possibly partial (bytes that
        started on a block boundary: what :func:`block_hashes` gives for them)."""
        return self.hashes + ([self._block.intdigest()] if self._filled else [])

    def hexdigest(self) -> str:
        if self.block_size is None:
            return f"{self._block.intdigest():016x}"
        hashes = self.hashes + ([self._block.intdigest()] if self._filled else [])
        if len(hashes) <= 1:  # a blob of one block or less carries no blocks: its own xxh3-64
            return f"{hashes[0] if hashes else xxhash.xxh3_64_intdigest(b''):016x}"
        return digest_of_table(pack(hashes))


def block_span(start: int, stop: int, length: int, block_size: int) -> tuple[int, int]:
    """``(first, end)``: the blocks covering the stored bytes ``[start, stop)`` of a blob of
    ``length`` bytes (``end`` exclusive)."""
    if not 0 <= start < stop <= length:
        raise ValueError(f"byte range {start}..{stop} outside a blob of {length} bytes")
    return start // block_size, block_count(stop, block_size)


def table_entries(table: bytes) -> np.ndarray:
    return np.frombuffer(table, dtype="<u8")


def check_blocks(entries: np.ndarray, first: int, hashes: Sequence[int]) -> int | None:
    """The index of the first block from ``first`` on whose hash differs from its table entry, or None."""
    for i, value in enumerate(hashes):
        if int(entries[first + i]) != value:
            return first + i
    return None

"""Where the bytes of a partly read chunk go: the scatter plan of a resharded load.

A resharded load reads whole blocks of a chunk (they are what is verified) but wants boxes of it.
Rather than staging the blocks and copying the boxes out, each piece read is a scatter read
(``preadv`` on a local mount) whose buffers are the *runs* of bytes a want's target holds
contiguously in memory — read there directly — and, between them, scratch for the bytes no want
needs, read only to be hashed. The buffers are cut at block boundaries and each block hashed across
its own (:func:`block_hashes_of`), so what reaches a target is exactly what was verified, with no
copy. The plan of a piece is array arithmetic (:func:`piece_buffers`): a slice per run, no Python
loop per row.

A want can be scattered when its box is whole in every dimension from the third on (so each dim-0
row of it is one byte run of the chunk) and its target is a CPU tensor of the chunk's dtype whose
rows (``target[j]``) are contiguous; rows whole and back to back in both make one run. Measured on
the benchmark box, a buffer per run pays off for whole rows of at least ``MIN_ROW_BYTES`` (8 KiB:
an FSDP×TP chunk into the column half of an FSDP shard) and, where the rest of each row goes to
scratch, for runs of at least ``MIN_RUN_BYTES`` (64 KiB); below that, or for a device target, a
strided row or overlapping boxes, :func:`row_maps` answers None and the window is staged and its
boxes copied out instead.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ..errors import CorruptCheckpointError
from ..format import Chunk
from ..format.blocks import block_span
from ..storage.base import read_scatter

MIN_RUN_BYTES = 64 << 10  # shorter runs: copying out of a staged window costs less than a buffer each
MIN_ROW_BYTES = 8 << 10  # whole rows into a strided target (FSDP×TP → FSDP): shorter, staging wins
MAX_WANTS = 16  # boxes of one chunk checked pairwise for overlap


def _storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s whole storage, as a writable memoryview."""
    whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
    return memoryview(whole.numpy()).cast("B")


@dataclass
class RowMap:
    """Rows ``lo..hi`` of the chunk (dim 0) that one want takes: row ``r``'s bytes
    ``r * row_bytes + first .. + run`` go to ``memory[base + (r - row0) * stride ..]``."""

    lo: int
    hi: int
    row0: int
    row_bytes: int
    first: int
    run: int
    memory: memoryview
    base: int
    stride: int

    def runs(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, stops, places)``: the stored byte runs of ``[start, stop)`` this want takes
        and where each begins in ``memory``."""
        if self.run == self.row_bytes and self.stride == self.row_bytes:  # rows back to back: one run
            a, b = max(start, self.lo * self.row_bytes), min(stop, self.hi * self.row_bytes)
            if a >= b:
                return _EMPTY, _EMPTY, _EMPTY
            return (np.array([a], np.int64), np.array([b], np.int64),
                    np.array([self.base + a - self.row0 * self.row_bytes], np.int64))
        rows = np.arange(max(self.lo, start // self.row_bytes), min(self.hi, -(-stop // self.row_bytes)),
                         dtype=np.int64)
        first = rows * self.row_bytes + self.first
        lo, hi = np.maximum(first, start), np.minimum(first + self.run, stop)
        keep = lo < hi
        rows, first, lo, hi = rows[keep], first[keep], lo[keep], hi[keep]
        return lo, hi, self.base + (rows - self.row0) * self.stride + lo - first


_EMPTY = np.zeros(0, np.int64)


def row_map(offsets, lengths, sizes, dtype: torch.dtype, target: torch.Tensor) -> RowMap | None:
    """How the box ``offsets``/``lengths`` of a chunk of ``sizes`` lands in ``target`` (the box's
    tensor), or None when it cannot be scattered into."""
    if (target.device.type != "cpu" or target.dtype != dtype or tuple(target.shape) != tuple(lengths)
            or any(lengths[d] != sizes[d] for d in range(2, len(sizes)))):
        return None
    itemsize = dtype.itemsize
    if len(sizes) == 1:
        if target.stride(0) != 1:
            return None
        first, run = 0, itemsize
    else:
        if not target[0].is_contiguous():
            return None
        inner = math.prod(sizes[2:]) * itemsize
        first, run = offsets[1] * inner, lengths[1] * inner
    row_bytes = math.prod(sizes[1:]) * itemsize
    stride = target.stride(0) * itemsize
    whole_rows = run == row_bytes
    if not (whole_rows and stride == row_bytes) and run < (MIN_ROW_BYTES if whole_rows else MIN_RUN_BYTES):
        return None
    return RowMap(offsets[0], offsets[0] + lengths[0], offsets[0], row_bytes, first, run,
                  _storage_bytes(target), target.storage_offset() * itemsize, stride)


def row_maps(wants, sizes, dtype: torch.dtype) -> list[RowMap] | None:
    """A :class:`RowMap` per want with bytes (``want.offsets``, ``.lengths``, ``.tensor()``), or
    None when any cannot be scattered into or two boxes overlap."""
    wants = [w for w in wants if all(w.lengths)]
    if len(wants) > MAX_WANTS:
        return None
    for i, a in enumerate(wants):
        for b in wants[i + 1:]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a.offsets, a.lengths, b.offsets, b.lengths)):
                return None
    maps = [row_map(w.offsets, w.lengths, sizes, dtype, w.tensor()) for w in wants]
    return None if any(m is None for m in maps) else maps


def piece_buffers(maps: list[RowMap], scratch: memoryview, scratch_start: int, start: int, stop: int,
                  block_size: int) -> tuple[list[memoryview], list[int]]:
    """The buffers of the stored bytes ``[start, stop)`` in order — target memory where a want
    takes them, else ``scratch`` (which holds the bytes from ``scratch_start`` on) — cut at every
    block boundary, and where each block's buffers begin in that list (``start`` on a block
    boundary). Worked out with array arithmetic, so that a box of many short runs (a column
    shard's half rows) costs a slice per run, not a loop of Python per run."""
    parts = [m.runs(start, stop) for m in maps]
    lo = np.concatenate([p[0] for p in parts])
    hi = np.concatenate([p[1] for p in parts])
    at = np.concatenate([p[2] for p in parts])
    owner = np.concatenate([np.full(len(p[0]), i, np.int64) for i, p in enumerate(parts)])
    if len(maps) > 1:
        order = np.argsort(lo, kind="stable")
        lo, hi, at, owner = lo[order], hi[order], at[order], owner[order]
    # the gaps between the runs (and before and after them) go to scratch
    gap_lo = np.concatenate([[start], hi])
    gap_hi = np.concatenate([lo, [stop]])
    gap = gap_lo < gap_hi
    seg_lo = np.concatenate([lo, gap_lo[gap]])
    seg_at = np.concatenate([at, gap_lo[gap] - scratch_start])
    seg_owner = np.concatenate([owner, np.full(int(gap.sum()), len(maps), np.int64)])
    order = np.argsort(seg_lo, kind="stable")
    seg_lo, seg_at, seg_owner = seg_lo[order], seg_at[order], seg_owner[order]
    seg_hi = np.append(seg_lo[1:], stop)
    if np.any(seg_lo // block_size != (seg_hi - 1) // block_size):  # cut at block boundaries
        cuts = np.union1d(seg_lo, np.arange(start, stop, block_size, dtype=np.int64))
        which = np.searchsorted(seg_lo, cuts, side="right") - 1
        seg_at, seg_owner = seg_at[which] + cuts - seg_lo[which], seg_owner[which]
        seg_lo, seg_hi = cuts, np.append(cuts[1:], stop)
    memories = [m.memory for m in maps] + [scratch]
    buffers = [memories[o][a: a + n] for o, a, n in zip(seg_owner.tolist(), seg_at.tolist(),
                                                             (seg_hi - seg_lo).tolist())]
    block = seg_lo // block_size
    starts = np.flatnonzero(np.diff(block, prepend=block[0] - 1)).tolist()
    return buffers, starts


def block_hashes_of(buffers: list[memoryview], starts: list[int]) -> list[int]:
    """The xxh3-64 of each block whose buffers begin at ``starts`` (as :func:`piece_buffers` gives)."""
    hashes = []
    for i, j in zip(starts, starts[1:] + [len(buffers)]):
        if j - i == 1:
            hashes.append(xxhash.xxh3_64_intdigest(buffers[i]))
            continue
        digest = xxhash.xxh3_64()
        for view in buffers[i:j]:
            digest.update(view)
        hashes.append(digest.intdigest())
    return hashes


class ScatterWindow:
    """A window read straight into its wants' targets (the bytes no want
    needs into scratch), each piece's blocks hashed across its buffers by the thread that read it,
    all checked before the wants it finishes are told."""

    def __init__(self, files, buffers, key, chunk: Chunk, maps, rows, row_bytes: int, finishing, piece: int):
        self.files, self.buffers, self.key, self.chunk, self.maps, self.finishing = files, buffers, key, chunk, maps, finishing
        blob = chunk.blob
        self.first, end = block_span(rows[0] * row_bytes, rows[1] * row_bytes, blob.length, blob.block_size)
        self.start_byte, self.stop_byte = self.first * blob.block_size, min(end * blob.block_size, blob.length)
        self.staged = self.stop_byte - self.start_byte  # scratch for what no want takes, at most this
        self.piece = max(piece // blob.block_size, 1) * blob.block_size
        self.futures: list[Future] = []

    def start(self, pool) -> None:
        blob = self.chunk.blob
        self.files.block_table(blob, what=self.key)  # read (and checked) before any block
        self.scratch = self.buffers.take(self.staged)
        scratch, handle = memoryview(self.scratch.numpy()), self.files.open(blob.file)

        def read(lo: int, hi: int) -> list[int]:
            views, blocks = piece_buffers(self.maps, scratch, self.start_byte, lo, hi, blob.block_size)
            if read_scatter(handle, views, blob.offset + lo) != hi - lo:
                raise CorruptCheckpointError(f"{self.files.root}: short read of {self.key} from {blob.file}",
                                             path=str(self.files.root), file=blob.file, tensor=self.key)
            return block_hashes_of(views, blocks)

        self.futures = [pool.submit(read, lo, min(lo + self.piece, self.stop_byte))
                        for lo in range(self.start_byte, self.stop_byte, self.piece)]

    def finish(self) -> None:
        hashes = [h for future in self.futures for h in future.result()]
        self.files.verify_blocks(self.chunk.blob, self.first, hashes, what=self.key)
        self.buffers.give(self.scratch)
        self.scratch = None
        for want in self.finishing:
            want.done(want.tensor())

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()

"""A load's data path: several verified reads in flight per rank, only the blocks a rank needs,
in a bounded read buffer.

:func:`read_chunks` takes the chunks one rank loads, each with the boxes of it that rank wants
(:class:`Want`: a box in chunk coordinates, the tensor it goes into, what to call once it is filled)
and turns each into jobs, started in order on a pool of reader threads while earlier jobs finish.
Files that other ranks read too (``together``: Shard(0) → Shard(1), where every rank needs part
of every block of every file) are read side by side, a job (a window of ~16 MiB) of each in turn,
each rank starting at another file (the caller's order, :mod:`ckpt.read.items`): the
pages another rank is pulling from storage are then copied from the page cache *while* storage
works on the next window (1 GiB of Shard(0) → Shard(1), cold, 10 loads each way alternated: 0.62 s
median against 0.79 s file by file). Other files are read one after another (side by side made no
difference for one process reading a pipeline's two files). The jobs:

* **direct** (a raw chunk one want takes whole into a contiguous CPU tensor, the live tensor when
  the layouts match): read straight into it in pieces of 2 MiB (16 MiB ranged GETs on an object
  store), in parallel; each piece hashed by
  the thread that read it (per block, version 3), the chunk's checksum compared once all pieces are
  in, and only then is the want told (commit-after-verify: its bytes are never handed on unchecked);
* **windows** (a raw version-3 chunk with blocks that the rank needs part of, or wants in a
  different box): the rows (dim 0) the wants cover are read in windows of about 16 MiB, each
  extended to whole blocks; every block of a window is checked against the chunk's block table
  (read once, itself checked against the manifest's checksum) before its want is told; blocks the
  rank does not need are never read (so a damaged block another rank needs does not fail this
  rank's load). Where the boxes allow (whole rows, or rows of long runs, into CPU targets:
  :mod:`ckpt.read.scatter`) a window is a scatter read straight into the targets, else it is staged
  and the boxes copied out;
* **whole** (anything else: a compressed or delta chunk, which decodes only whole; a version-1/2
  chunk, whose one checksum covers the whole blob; a scalar): the chunk read and verified whole
  (:meth:`ChunkSource.tensor`), then copied into each want's box;
* **batches** (object stores only: neighbouring small direct chunks of one file): one ranged GET,
  each chunk verified before it is copied into its target (:mod:`ckpt.read.batch`).

Memory: the windows and whole chunks in flight hold at most ``BUFFER_BYTES`` (64 MiB) — or one job,
when a single one is larger: a window is at most ``WINDOW_BYTES`` plus two blocks, or one dim-0 row
of its chunk when a row is larger; a whole job holds its chunk (stored + decoded bytes). So a
version-3 raw load peaks at the live state plus 64 MiB (plus block tables, 8 bytes per MiB).
"""

from __future__ import annotations

import itertools
import math
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from ..errors import CorruptCheckpointError
from ..format import Blob, Chunk, checksum, codec
from .batch import Batch, batched
from .scatter import ScatterWindow, row_maps
from ..format.blocks import block_hashes, block_span, digest_of_table, pack

REMOTE_READ_THREADS = 8  # ranged GETs in flight per rank on an object store
MAX_READ_THREADS = 8  # positional reads in flight per rank on a local mount, side-by-side files included
PIECE_BYTES = 2 << 20  # one positional read on a local mount (a multiple of the block size)
REMOTE_PIECE_BYTES = 16 << 20  # one ranged GET (fewer, larger requests: each costs a round trip)
WINDOW_BYTES = 16 << 20  # rows read together when a chunk is read in part
BUFFER_BYTES = 64 << 20  # staged bytes in flight per rank (the read buffer's bound)
MAX_JOBS = 8  # jobs in flight (direct reads hold no buffer of their own)


def local_read_threads(side_by_side: int = 0) -> int:
    """Positional reads in flight per rank on a local mount: one per core, 2 to 4 (each thread also
    hashes what it read; 4 × 8 MiB spread out measured 2-3x slower than 2 × 2 MiB on the benchmark
    box), plus one per further file read side by side, at most ``MAX_READ_THREADS``: such a thread
    often waits on pages another rank is still fetching, leaving this rank's own file without reads
    in flight (Shard(0) → Shard(1): ~1.05 × the same-layout load with 3-4 threads, 1.15-1.33 with
    2; benchmarks/CHECKS.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return min(MAX_READ_THREADS, max(2, min(4, cores)) + max(0, side_by_side - 1))


@dataclass
class Want:
    """A box of a stored chunk (``offsets``/``lengths`` in the chunk's coordinates) to fill:
    ``target()`` resolves the tensor of the box's shape, ``done(tensor)`` is called once every byte
    of it was verified and copied."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    target: Callable[[], torch.Tensor]
    done: Callable[[torch.Tensor], None]
    _tensor: torch.Tensor | None = field(default=None, repr=False)

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self.target()
        return self._tensor


def read_chunks(source, requests: Iterable[tuple[str, Chunk, list[Want], torch.Tensor | None]], *,
                together: frozenset[str] = frozenset(), threads: int | None = None,
                budget: int = BUFFER_BYTES) -> None:
    """Load every ``(key, chunk, wants, direct)`` of ``source`` (a :class:`~ckpt.read.source.ChunkSource`
    whose files were checked for truncation): ``direct`` (or None) the contiguous CPU tensor of the
    chunk's dtype and sizes the single want takes it into whole. The chunks of each file are read
    in the order given; first the files named in ``together``, a job of each in turn, then the
    others one by one, each group in the order of its files' first chunks."""
    local = source.path.storage.is_local
    piece = PIECE_BYTES if local else REMOTE_PIECE_BYTES
    by_file = _by_file(requests)
    if threads is None:
        threads = local_read_threads(len(together & by_file.keys())) if local else REMOTE_READ_THREADS
    pending: deque = deque()
    held = 0
    buffers = _Buffers()
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-read") as pool:
        try:
            files = {name: (job for request in (stream if local else batched(stream, piece))
                            for job in _jobs(source, buffers, request, piece))
                     for name, stream in by_file.items()}
            side_by_side = _in_turn([jobs for name, jobs in files.items() if name in together])
            one_by_one = (job for name, jobs in files.items() if name not in together for job in jobs)
            for job in itertools.chain(side_by_side, one_by_one):
                while pending and (held + job.staged > budget or len(pending) >= MAX_JOBS):
                    done = pending.popleft()
                    held -= done.staged
                    done.finish()
                job.start(pool)
                pending.append(job)
                held += job.staged
            while pending:
                pending.popleft().finish()
        finally:
            for job in pending:
                job.cancel()


def _by_file(requests) -> dict[str, list]:
    """The requests grouped by data file, each group in the given order, the groups in the order
    of their first request."""
    files: dict[str, list] = {}
    for request in requests:
        files.setdefault(request[1].blob.file, []).append(request)
    return files


def _in_turn(iterators: list) -> Iterable:
    """One item of each iterator in turn (round robin) until all are spent."""
    live = deque(iterators)
    while live:
        iterator = live.popleft()
        for item in iterator:
            yield item
            live.append(iterator)
            break


def _jobs(source, buffers, request, piece):
    if isinstance(request, list):  # small neighbours read in one GET (ckpt.read.batch)
        yield Batch(source.files, request)
        return
    key, chunk, wants, direct = request
    dtype, blob = source.manifest.tensors[key].dtype, chunk.blob
    if blob.codec == codec.RAW and direct is not None:
        yield _Direct(source.files, key, blob, direct, wants[0].done, piece)
    elif blob.codec == codec.RAW and blob.block_size is not None and chunk.sizes:
        yield from _windows(source.files, buffers, key, chunk, dtype, wants, piece)
    else:
        yield _Whole(source, key, chunk, wants)


class _Job:
    staged = 0

    def start(self, pool: ThreadPoolExecutor) -> None:
        self.futures: list[Future] = []

    def finish(self) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        for future in getattr(self, "futures", ()):
            future.cancel()

    def _hashes(self) -> list[int]:
        return [h for future in self.futures for h in future.result()]


def _submit(pool, files, key: str, blob: Blob, buffer: memoryview, start: int, piece: int) -> list[Future]:
    """Read the stored bytes ``[start, start + len(buffer))`` of ``blob`` into ``buffer`` in pieces
    on ``pool``; each future returns the block hashes of its piece (``start`` on a block boundary),
    or nothing for a blob without blocks."""
    size = blob.block_size
    piece = piece if size is None else max(piece // size, 1) * size
    handle = files.open(blob.file)

    def read(lo: int, hi: int) -> list[int]:
        view = buffer[lo - start: hi - start]
        if handle.read_into(view, blob.offset + lo) != hi - lo:
            raise CorruptCheckpointError(f"{files.root}: short read of {key} from {blob.file}",
                                         path=str(files.root), file=blob.file, tensor=key)
        return [] if size is None else block_hashes(view, size)

    stop = start + len(buffer)
    return [pool.submit(read, lo, min(lo + piece, stop)) for lo in range(start, stop, piece)]


class _Direct(_Job):
    def __init__(self, files, key: str, blob: Blob, target: torch.Tensor, done, piece: int):
        self.files, self.key, self.blob, self.target, self.done, self.piece = files, key, blob, target, done, piece
        self.view = memoryview(target.reshape(-1).view(torch.uint8).numpy())

    def start(self, pool) -> None:
        self.futures = _submit(pool, self.files, self.key, self.blob, self.view, 0, self.piece) if self.blob.length else []

    def finish(self) -> None:
        hashes = self._hashes()
        digest = digest_of_table(pack(hashes)) if self.blob.block_size is not None else checksum(self.view)
        self.files.verify(self.blob, digest, what=self.key)
        self.done(self.target)


def _windows(files, buffers, key: str, chunk: Chunk, dtype: torch.dtype, wants: list[Want], piece: int):
    """Windows of whole dim-0 rows over the rows the wants cover; each want is told after its last."""
    row_bytes = math.prod(chunk.sizes[1:]) * dtype.itemsize
    spans = sorted((w.offsets[0], w.offsets[0] + w.lengths[0], w) for w in wants)
    rows = max(1, WINDOW_BYTES // max(row_bytes, 1))
    windows: list[tuple[int, int]] = []
    merged_lo, merged_hi = None, None
    for lo, hi, _ in spans + [(None, None, None)]:
        if lo is not None and merged_hi is not None and lo <= merged_hi:
            merged_hi = max(merged_hi, hi)
            continue
        if merged_lo is not None and merged_hi > merged_lo:
            windows.extend((w, min(w + rows, merged_hi)) for w in range(merged_lo, merged_hi, rows))
        merged_lo, merged_hi = lo, hi
    last: dict[int, int] = {}
    for index, (w0, w1) in enumerate(windows):
        for lo, hi, want in spans:
            if lo < w1 and w0 < hi:
                last[id(want)] = index
    empty = [want for lo, hi, want in spans if lo >= hi]
    maps = row_maps(wants, chunk.sizes, dtype)
    for index, (w0, w1) in enumerate(windows):
        finishing = [want for _, _, want in spans if last.get(id(want)) == index]
        if maps is not None:
            yield ScatterWindow(files, buffers, key, chunk, maps, (w0, w1), row_bytes, finishing, piece)
        else:
            yield _Window(files, buffers, key, chunk, dtype, (w0, w1), row_bytes, spans, finishing, piece)
    for want in empty:  # a box with no rows holds no bytes
        want.done(want.tensor())


class _Window(_Job):
    def __init__(self, files, buffers, key, chunk: Chunk, dtype, rows, row_bytes, spans, finishing, piece):
        self.piece = piece
        self.buffers, self.files, self.key, self.chunk, self.dtype = buffers, files, key, chunk, dtype
        self.rows, self.row_bytes, self.spans, self.finishing = rows, row_bytes, spans, finishing
        blob = chunk.blob
        self.first, end = block_span(rows[0] * row_bytes, rows[1] * row_bytes, blob.length, blob.block_size)
        self.start_byte = self.first * blob.block_size
        self.staged = min(end * blob.block_size, blob.length) - self.start_byte

    def start(self, pool) -> None:
        self.files.block_table(self.chunk.blob, what=self.key)  # read (and checked) before any block
        self.buffer = self.buffers.take(self.staged)
        self.futures = _submit(pool, self.files, self.key, self.chunk.blob, memoryview(self.buffer.numpy()),
                               self.start_byte, self.piece)

    def finish(self) -> None:
        blob, (w0, w1) = self.chunk.blob, self.rows
        self.files.verify_blocks(blob, self.first, self._hashes(), what=self.key)
        skip = w0 * self.row_bytes - self.start_byte
        window = self.buffer[skip: skip + (w1 - w0) * self.row_bytes].view(self.dtype)
        window = window.reshape((w1 - w0, *self.chunk.sizes[1:]))
        for lo, hi, want in self.spans:
            lo, hi = max(lo, w0), min(hi, w1)
            if lo >= hi:
                continue
            piece = window.narrow(0, lo - w0, hi - lo)
            for dim in range(1, len(want.offsets)):
                piece = piece.narrow(dim, want.offsets[dim], want.lengths[dim])
            want.tensor().narrow(0, lo - want.offsets[0], hi - lo).copy_(piece)
        self.buffers.give(self.buffer)
        self.buffer = window = None
        for want in self.finishing:
            want.done(want.tensor())


class _Buffers:
    """Window buffers reused from one window to the next (windows are mostly of one size): the
    memory a load stages stays what is in flight, not what the allocator keeps after churn."""

    def __init__(self):
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        for i, buffer in enumerate(self._free):
            if buffer.numel() >= nbytes:
                return self._free.pop(i)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        whole = torch.empty(0, dtype=torch.uint8).set_(buffer.untyped_storage())
        self._free.append(whole)
        if len(self._free) > MAX_JOBS:
            self._free.sort(key=torch.Tensor.numel)
            self._free.pop(0)


class _Whole(_Job):
    def __init__(self, source, key: str, chunk: Chunk, wants: list[Want]):
        self.source, self.key, self.chunk, self.wants = source, key, chunk, wants
        self.staged = chunk.blob.length + chunk.blob.decoded_length

    def start(self, pool) -> None:
        self.futures = []
        if self.chunk.blob.codec == codec.RAW and self.chunk.blob.length:
            # A raw chunk (a small one a rank needs part of, most often) is read on the pool like
            # the others; its file is opened here, on the loading thread. A coded chunk decodes
            # through its chain, which opens sources as it goes: that stays on this thread.
            self.source.files.check(self.chunk.blob, what=self.key)
            self.futures = [pool.submit(self.source.tensor, self.key, self.chunk)]

    def finish(self) -> None:
        stored = self.futures[0].result() if self.futures else self.source.tensor(self.key, self.chunk)
        for want in self.wants:
            piece = stored
            for dim, (start, length) in enumerate(zip(want.offsets, want.lengths)):
                piece = piece.narrow(dim, start, length)
            target = want.tensor()
            target.copy_(piece)
            want.done(target)

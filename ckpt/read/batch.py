"""Small chunks read together from an object store: one ranged GET for neighbours in a file.

On an object store every request costs a round trip (and a real store bills it), so a load of a
model's many small tensors (norms, biases, step counters' tensors) must not make one GET each.
:func:`batched` groups consecutive direct reads (raw chunks each taken whole into its target) that
lie in the same data file, each smaller than one ranged GET, with at most ``MAX_GAP`` bytes
between neighbours, into spans of at most one GET's size. A :class:`Batch` reads its span into one
staged buffer, then verifies each chunk's bytes against its own checksum before copying them into
its target and telling its want (commit-after-verify, as every read). Larger chunks keep their own
pieces. Local mounts do not batch: a positional read costs no round trip, and batching would add a
copy.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from ..errors import CorruptCheckpointError
from ..format import codec
from ..format.blocks import blob_digest

MAX_GAP = 64 << 10  # bytes between two chunks read in one GET anyway (alignment, small values)


def _small_direct(request, limit: int) -> bool:
    _, chunk, _, direct = request
    return direct is not None and chunk.blob.codec == codec.RAW and 0 < chunk.blob.length < limit


def batched(requests, limit: int):
    """``requests`` (sorted by file and offset) with runs of small direct reads replaced by lists
    of them (each list spanning at most ``limit`` bytes of one file)."""
    group: list = []
    for request in requests:
        if _small_direct(request, limit):
            blob = request[1].blob
            if group:
                first, last = group[0][1].blob, group[-1][1].blob
                gap = blob.offset - (last.offset + last.length)
                if (blob.file != first.file or not 0 <= gap <= MAX_GAP
                        or blob.offset + blob.length - first.offset > limit):
                    yield from _flush(group)
                    group = []
            group.append(request)
            continue
        yield from _flush(group)
        group = []
        yield request
    yield from _flush(group)


def _flush(group: list):
    if len(group) == 1:
        yield group[0]
    elif group:
        yield group


class Batch:
    """One read of the span of several small direct chunks (see the module docstring)."""

    def __init__(self, files, requests: list):
        self.files, self.requests = files, requests
        first, last = requests[0][1].blob, requests[-1][1].blob
        self.file, self.start_byte = first.file, first.offset
        self.staged = last.offset + last.length - first.offset
        self.futures: list[Future] = []

    def start(self, pool) -> None:
        self.buffer = torch.empty(self.staged, dtype=torch.uint8)
        handle = self.files.open(self.file)
        view = memoryview(self.buffer.numpy())

        def read() -> None:
            if handle.read_into(view, self.start_byte) != self.staged:
                raise CorruptCheckpointError(f"{self.files.root}: short read from {self.file}",
                                             path=str(self.files.root), file=self.file)

        self.futures = [pool.submit(read)]

    def finish(self) -> None:
        self.futures[0].result()
        for key, chunk, wants, direct in self.requests:
            blob = chunk.blob
            stored = self.buffer[blob.offset - self.start_byte: blob.offset - self.start_byte + blob.length]
            self.files.verify(blob, blob_digest(memoryview(stored.numpy()), blob.block_size), what=key)
            direct.reshape(-1).view(torch.uint8).copy_(stored)
            wants[0].done(direct)
        self.buffer = None

    def cancel(self) -> None:
        for future in self.futures:
            future.cancel()

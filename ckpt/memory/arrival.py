"""A data file's blobs checked against its manifest while the file's bytes arrive, in order: the
checks :func:`ckpt.read.verify_blobs` makes on a file read back, made on the bytes in passing (a
partner copy's receiver, :mod:`ckpt.memory.partner`), so the file is never read again to be verified.

    check = ArrivingFile(name, size, blobs_of(manifest)[name])   # refused at once: size, bounds
    check.update(piece); ...                                      # each piece in file order
    check.finish()                                                # every blob and block table checked

What it refuses (:class:`~ckpt.errors.CorruptCheckpointError`, naming the file and the blob's key):
a file whose size is not the manifest's (before a byte is taken), a blob or block table that does
not lie inside the file (likewise), a blob whose bytes do not hash to its checksum (the xxh3-64 of
its bytes, or, for a version-3 blob, of its per-block checksums: :class:`ckpt.format.blocks.StreamDigest`),
a version-3 blob's stored block table that is not the table of its verified bytes, and a file
that ends before its size. A blob fails as soon as its last byte has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CorruptCheckpointError
from ..format import Blob, Manifest
from ..format.blocks import StreamDigest, pack, table_bytes


def blobs_of(manifest: Manifest) -> dict[str, list[tuple[str, Blob]]]:
    """The manifest's ``(key, blob)`` pairs by data file."""
    by_file: dict[str, list[tuple[str, Blob]]] = {name: [] for name in manifest.data_files()}
    for key, blob in manifest.blobs():
        by_file[blob.file].append((key, blob))
    return by_file


@dataclass
class _Span:
    """Bytes ``[start, end)`` of the file and what takes them: a blob's digest, or its table's bytes."""
    start: int
    end: int
    key: str
    blob: Blob
    digest: StreamDigest | None = None  # a blob's bytes
    kept: bytearray | None = None  # a block table's bytes
    of: "_Span | None" = None  # a block table's: its blob's span

    def take(self, view: memoryview) -> None:
        if self.digest is not None:
            self.digest.update(view)
        else:
            self.kept += view


class ArrivingFile:
    """One data file (``size`` bytes, holding ``blobs``: ``(key, blob)`` pairs of its manifest)
    checked while its bytes arrive (see the module docstring)."""

    def __init__(self, name: str, size: int, blobs: list[tuple[str, Blob]], *, expected_size: int | None = None):
        self.name, self.size, self.position = name, size, 0
        if expected_size is not None and size != expected_size:
            raise self._corrupt(f"{name} holds {size} bytes, its manifest says {expected_size}")
        spans = []
        for key, blob in blobs:
            spans.append(_Span(blob.offset, blob.offset + blob.length, key, blob, digest=StreamDigest(blob.block_size)))
            if blob.block_table is not None and blob.block_size is not None:
                start = blob.block_table
                spans.append(_Span(start, start + table_bytes(blob.length, blob.block_size), key, blob,
                                   kept=bytearray(), of=spans[-1]))
        for span in spans:
            if not 0 <= span.start <= span.end <= size:
                what = "block table" if span.kept is not None else "bytes"
                raise self._corrupt(f"{name} is truncated ({size} bytes) - the {what} of {span.key} need bytes "
                                    f"{span.start}..{span.end}", span.key)
        self._waiting = sorted(spans, key=lambda span: span.start, reverse=True)  # next to start: last
        self._open: list[_Span] = []
        self._tables: list[_Span] = []  # checked at the end: a table may come before its blob's last byte

    def update(self, piece) -> None:
        """The next bytes of the file (after those of the previous call)."""
        view = memoryview(piece).cast("B")
        start, end = self.position, self.position + len(view)
        if end > self.size:
            raise self._corrupt(f"{self.name} runs past its {self.size} bytes")
        while self._waiting and self._waiting[-1].start < end:
            self._open.append(self._waiting.pop())
        still = []
        for span in self._open:
            low, high = max(span.start, start), min(span.end, end)
            if high > low:
                span.take(view[low - start: high - start])
            if span.end <= end:
                self._close(span)
            else:
                still.append(span)
        self._open, self.position = still, end

    def finish(self) -> None:
        """The file is over: it must have reached its size, and every blob and table passed."""
        if self.position != self.size:
            raise self._corrupt(f"{self.name} ended at byte {self.position} of {self.size}")
        for span in [*self._open, *reversed(self._waiting)]:  # empty ones at the very end
            self._close(span)
        self._open, self._waiting = [], []
        for table in self._tables:
            if bytes(table.kept) != pack(table.of.digest.blocks()):
                raise self._corrupt(f"the block table of {table.key} in {self.name} at byte {table.start} is not "
                                    "the table of its bytes", table.key)

    def _close(self, span: _Span) -> None:
        if span.kept is not None:
            self._tables.append(span)
            return
        digest = span.digest.hexdigest()
        if digest != span.blob.checksum:
            raise self._corrupt(f"checksum mismatch for {span.key} in {self.name} at byte {span.start} "
                                f"(stored {span.blob.checksum}, received {digest})", span.key)

    def _corrupt(self, message: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, file=self.name, tensor=key)

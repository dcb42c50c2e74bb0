"""One checkpoint's data files, read and verified: the read side's bytes (see :mod:`ckpt.read.source`).

:class:`DataFiles` opens a checkpoint's data files below its directory without following links
(names as validated in its manifest, each opened once), refuses a blob or a block table that does
not lie inside its file before allocating for it, reads blobs with positional reads straight into
the caller's buffer and checks them against their checksums (the xxh3-64 of the bytes, or of the
per-block checksums of a version-3 blob: :mod:`ckpt.format.blocks`). :func:`verify_blobs` checks
a whole checkpoint that way without decoding it (``ckpt-inspect --verify``, a replica's read-back).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..errors import CheckpointError, CorruptCheckpointError, InvalidManifestError
from ..format import Blob, Manifest, is_data_file_name
from ..format.blocks import blob_digest, block_hashes, check_blocks, digest_of_table, table_bytes, table_entries
from ..storage import Location, ReadHandle


class DataFiles:
    """Read access to the data files of one checkpoint directory (names as validated in its
    manifest, opened below the directory without following links)."""

    def __init__(self, root: Location):
        self.root = root
        self._handles: dict[str, ReadHandle] = {}
        self._tables: dict[Blob, np.ndarray] = {}

    def open(self, name: str) -> ReadHandle:
        """The data file ``name`` (validated, below the directory), opened once."""
        return self._open(name)

    def _open(self, name: str) -> ReadHandle:
        if name not in self._handles:
            if not is_data_file_name(name):
                raise InvalidManifestError(f"{self.root}: illegal data file name {name!r}", path=str(self.root),
                                           file=name)
            self._handles[name] = self.root.storage.open_read(self.root.path, name)
        return self._handles[name]

    def check(self, blob: Blob, *, what: str) -> ReadHandle:
        """Refuse a blob that lies beyond the end of its file; call before allocating for it."""
        handle = self._open(blob.file)
        if blob.offset + blob.length > handle.size:
            raise CorruptCheckpointError(
                f"{self.root}: {blob.file} is truncated ({handle.size} bytes) - {what} needs bytes "
                f"{blob.offset}..{blob.offset + blob.length}",
                path=str(self.root), file=blob.file, tensor=what,
            )
        return handle

    def check_table(self, blob: Blob, *, what: str) -> None:
        """Refuse a version-3 blob whose block table lies beyond the end of its file (a file cut
        inside its tables): checked with the blobs, before a load writes anything."""
        if blob.block_size is not None:
            handle, length = self._open(blob.file), table_bytes(blob.length, blob.block_size)
            if blob.block_table + length > handle.size:
                raise CorruptCheckpointError(
                    f"{self.root}: {blob.file} is truncated ({handle.size} bytes) - the block table of {what} "
                    f"needs bytes {blob.block_table}..{blob.block_table + length}",
                    path=str(self.root), file=blob.file, tensor=what)

    def read_into(self, blob: Blob, buffer: memoryview, *, what: str) -> None:
        """Fill ``buffer`` (exactly ``blob.length`` bytes) with the blob's stored bytes, unverified."""
        handle = self.check(blob, what=what)
        if handle.read_into(buffer, blob.offset) != blob.length:
            raise CorruptCheckpointError(f"{self.root}: short read of {what} from {blob.file}",
                                         path=self.root, file=blob.file, tensor=what)

    def read(self, blob: Blob, *, what: str) -> bytearray:
        """The blob's stored bytes, verified."""
        self.check(blob, what=what)
        buffer = bytearray(blob.length)
        self.read_into(blob, memoryview(buffer), what=what)
        self.verify(blob, blob_digest(buffer, blob.block_size), what=what)
        return buffer

    def verify(self, blob: Blob, digest: str, *, what: str) -> None:
        if digest != blob.checksum:
            raise CorruptCheckpointError(
                f"{self.root}: checksum mismatch for {what} in {blob.file} at byte {blob.offset} "
                f"(stored {blob.checksum}, read {digest})",
                path=self.root, file=blob.file, tensor=what,
            )

    def block_table(self, blob: Blob, *, what: str) -> np.ndarray:
        """A version-3 blob's block table (one xxh3-64 per block), checked against the manifest's
        checksum and that it lies inside its file before it is read; read once per blob."""
        entries = self._tables.get(blob)
        if entries is None:
            self.check_table(blob, what=what)
            handle, length = self._open(blob.file), table_bytes(blob.length, blob.block_size)
            table = bytearray(length)
            if handle.read_into(memoryview(table), blob.block_table) != length:
                raise CorruptCheckpointError(f"{self.root}: short read of {what}'s block table",
                                             path=str(self.root), file=blob.file, tensor=what)
            digest = digest_of_table(table)
            if digest != blob.checksum:
                raise CorruptCheckpointError(
                    f"{self.root}: checksum mismatch for {what}'s block table in {blob.file} at byte "
                    f"{blob.block_table} (stored {blob.checksum}, read {digest})",
                    path=str(self.root), file=blob.file, tensor=what)
            entries = self._tables[blob] = table_entries(bytes(table))
        return entries

    def verify_blocks(self, blob: Blob, first: int, hashes: list[int], *, what: str) -> None:
        """Blocks ``first, first + 1, ...`` of ``blob`` hashed to ``hashes``: each must match its
        table entry."""
        bad = check_blocks(self.block_table(blob, what=what), first, hashes)
        if bad is not None:
            raise CorruptCheckpointError(
                f"{self.root}: checksum mismatch for {what} in {blob.file} at byte "
                f"{blob.offset + bad * blob.block_size} (block {bad} of {blob.block_size} bytes)",
                path=str(self.root), file=blob.file, tensor=what)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def verify_blobs(path: Location, manifest: Manifest, *, files: Iterable[str] | None = None,
                 progress: Callable[[int], None] | None = None,
                 failed: Callable[[str, Blob, Exception], None] | None = None) -> None:
    """Read every blob of the checkpoint at ``path`` (of the data files ``files`` only, when given)
    and check it against its checksum (a version-3 blob with blocks: also its stored block table,
    block by block), in the manifest's order (:meth:`Manifest.blobs`);
    ``progress(length)`` after each. A data file whose size is not the manifest's (``files``: longer
    is damage too, as for ``ckpt-copy``) fails before its first blob is read. The first that fails
    raises; with ``failed``, each failure (a :class:`~ckpt.errors.CheckpointError` or an ``OSError``)
    is handed to ``failed(key, blob, error)`` instead (a file's size: key None, its first blob) and
    the next blob is read. The one whole-checkpoint verification: ``ckpt-inspect --verify`` and a
    replica's read-back (:mod:`ckpt.root.copy`)."""
    wanted = None if files is None else set(files)
    data, sized = DataFiles(path), set()
    try:
        for key, blob in manifest.blobs():
            if wanted is not None and blob.file not in wanted:
                continue
            if blob.file not in sized and manifest.files.get(blob.file) is not None:
                sized.add(blob.file)
                try:
                    size = data.open(blob.file).size
                except (CheckpointError, OSError):
                    size = None  # missing or unreadable: its blobs say so
                if size is not None and size != manifest.files[blob.file]:
                    exc = CorruptCheckpointError(f"{path}: {blob.file} holds {size} bytes, its manifest says "
                                                 f"{manifest.files[blob.file]}", path=str(path), file=blob.file)
                    if failed is None:
                        raise exc
                    failed(None, blob, exc)
            try:
                if blob.block_size is None:
                    data.read(blob, what=key)
                else:  # block by block against the stored table (itself checked): names the bad block
                    data.check(blob, what=key)
                    stored = bytearray(blob.length)
                    data.read_into(blob, memoryview(stored), what=key)
                    data.verify_blocks(blob, 0, block_hashes(stored, blob.block_size), what=key)
            except (CheckpointError, OSError) as exc:
                if failed is None:
                    raise
                failed(key, blob, exc)
            if progress is not None:
                progress(blob.length)
    finally:
        data.close()

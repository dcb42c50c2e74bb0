"""The read side: locate → read → verify → decode, delta chains included. The one path every
load, replay and tool takes to a checkpoint's bytes.

1. locate  :func:`~ckpt.read.committed.read_manifest` opens a committed checkpoint and validates its
           manifest before anything in it is used (:mod:`ckpt.format.validate`);
2. read    :class:`~ckpt.read.files.DataFiles` reads a blob with positional reads straight into the caller's buffer
           (the live tensor when the layouts match), confined to the checkpoint directory, refusing
           blobs beyond the end of their file before allocating for them;
3. verify  every blob's checksum, before its bytes are handed on (a direct read into a live
           tensor is hashed while the next chunk is read, and committed only once it verifies): the
           xxh3-64 of its bytes, or, for a version-3 blob longer than a block, of its per-block
           checksums (:mod:`ckpt.format.blocks`); :func:`verify_blobs` checks a whole checkpoint
           that way without decoding it. A load reads through :mod:`ckpt.read.prefetch` (parallel reads,
           only the blocks a rank needs, each verified);
4. decode  :class:`ChunkSource` turns stored bytes back into raw ones (:mod:`ckpt.format.codec`); a
           ``delta``/``unchanged`` chunk is decoded against the chunk at the same offsets in the
           base checkpoint (a sibling directory, itself possibly a delta, down to the last full).
           A missing, corrupt or looping link raises :class:`~ckpt.errors.CorruptCheckpointError`
           naming it. Values decode from tagged JSON, or from a ``torch.save`` stream read with
           ``weights_only=True`` only.
"""

from __future__ import annotations

import io
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from .committed import read_manifest
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidManifestError,
    UnsafeCheckpointError,
)
from ..format import MANIFEST_NAME, Chunk, Manifest, ValueEntry, codec, values
from ..format.blocks import blob_digest
from ..storage import Location
from .chain import MAX_CHAIN, ChainLoopError, check_link  # noqa: F401  (ckpt.read.MAX_CHAIN)
from .files import DataFiles, verify_blobs  # noqa: F401  (ckpt.read.DataFiles, .verify_blobs)

log = logging.getLogger(__name__)


class ChunkSource:
    """Verified, decoded chunks and values of one checkpoint (and, through it, of its chain)."""

    def __init__(self, path: Location, manifest: Manifest | None = None, *,
                 mirrors: tuple[Location, ...] = (), _seen: tuple = ()):
        self.path = path
        self.manifest = manifest if manifest is not None else read_manifest(self.path)
        self.files = DataFiles(self.path)
        self.mirrors = tuple(mirrors)  # other roots holding copies of the chain's links
        self._seen = _seen or (self.path.storage.identity(self.path.path),)  # the chain's links so far, this one last
        self._bases: list[ChunkSource | CheckpointError] | None = None
        self._index: dict[tuple[str, tuple], Chunk] | None = None

    # -- tensors -----------------------------------------------------------------------------
    def read_tensors(self, requests: Iterable[tuple[Any, str, Chunk, torch.Tensor | None]]
                     ) -> Iterator[tuple[Any, torch.Tensor]]:
        """For each ``(tag, key, chunk, into)``: ``(tag, tensor)`` holding the chunk, verified.

        ``into`` (or None) is a contiguous CPU tensor of the chunk's dtype and sizes to read a raw
        chunk into directly; it is then the tensor yielded, after its checksum (computed while the
        following chunks are read) matched. Other chunks are yielded in request order."""
        deferred = []
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify") as hasher:
            for tag, key, chunk, into in requests:
                if into is not None and chunk.blob.codec == codec.RAW:
                    view = into.reshape(-1).view(torch.uint8).numpy()
                    self.files.read_into(chunk.blob, memoryview(view), what=key)
                    deferred.append((tag, key, chunk.blob, into, hasher.submit(blob_digest, view, chunk.blob.block_size)))
                    continue
                yield tag, self.tensor(key, chunk)
            for tag, key, blob, into, digest in deferred:
                self.files.verify(blob, digest.result(), what=key)
                yield tag, into

    def tensor(self, key: str, chunk: Chunk) -> torch.Tensor:
        """The chunk as a new tensor (its dtype and sizes), verified and decoded."""
        dtype = self.manifest.tensors[key].dtype
        if chunk.blob.codec != codec.RAW:
            return torch.from_numpy(self.raw(key, chunk)).view(dtype).reshape(chunk.sizes)
        self.files.check(chunk.blob, what=key)
        stored = torch.empty(chunk.sizes, dtype=dtype)
        view = stored.reshape(-1).view(torch.uint8).numpy()
        self.files.read_into(chunk.blob, memoryview(view), what=key)
        self.files.verify(chunk.blob, blob_digest(view, chunk.blob.block_size), what=key)
        return stored

    def raw(self, key: str, chunk: Chunk) -> np.ndarray:
        """The chunk's raw bytes (a uint8 array), verified and decoded through the chain."""
        blob = chunk.blob
        stored = self.files.read(blob, what=key) if blob.length else b""
        base = self._base_raw(key, chunk) if blob.codec in codec.NEEDS_BASE else None
        try:
            return codec.decode(blob.codec, stored, raw_length=blob.decoded_length,
                                itemsize=self.manifest.tensors[key].dtype.itemsize,
                                planes=blob.planes, base=base, what=f"{self.path}: {key}")
        except CheckpointError as exc:
            exc.path, exc.file, exc.tensor = exc.path or str(self.path), exc.file or blob.file, exc.tensor or key
            raise

    def find(self, key: str, offsets: tuple, sizes: tuple) -> Chunk | None:
        """The chunk of ``key`` at ``offsets`` with ``sizes``, if this checkpoint has one."""
        if self._index is None:
            self._index = {(k, c.offsets): c for k, entry in self.manifest.tensors.items() for c in entry.chunks}
        chunk = self._index.get((key, tuple(offsets)))
        return chunk if chunk is not None and chunk.sizes == tuple(sizes) else None

    def _base_raw(self, key: str, chunk: Chunk) -> np.ndarray:
        """The raw bytes of the base's chunk at the same offsets: from the sibling base checkpoint,
        else from the same link on a mirror (link by link: each link may come from another mount)."""
        failure: CheckpointError | None = None
        for source in self.bases():
            if isinstance(source, CheckpointError):
                failure = failure or source
                continue
            base_chunk = source.find(key, chunk.offsets, chunk.sizes)
            if base_chunk is None:
                failure = failure or CorruptCheckpointError(
                    f"delta chain broken: {key} in {self.path.name} has no matching chunk in its base "
                    f"{source.path}", path=str(source.path), file=MANIFEST_NAME, tensor=key)
                continue
            try:
                raw = source.raw(key, base_chunk)
            except CorruptCheckpointError as exc:
                failure = failure or exc
                continue
            if source.path.parent != self.path.parent:
                log.info("%s: base chunk %s served by %s", self.path.name, key, source.path)
            return raw
        raise failure

    def bases(self) -> list["ChunkSource | CheckpointError"]:
        """This delta's base checkpoint on its own mount, then on each mirror: an open source, or
        the error that kept it from opening (a sibling that is not a symbolic link: reads stay
        inside the roots)."""
        if self._bases is None:
            name = self.manifest.base
            if name is None:
                raise CorruptCheckpointError(f"{self.path} stores delta chunks but names no base",
                                             path=str(self.path), file=MANIFEST_NAME)
            roots = [self.path.parent, *(m for m in self.mirrors if m != self.path.parent)]
            self._bases = [self._open_base(root / name, name) for root in roots]
        return self._bases

    def _open_base(self, path: Location, name: str) -> "ChunkSource | CheckpointError":
        identity = path.storage.identity(path.path)
        try:
            check_link(self._seen, identity)  # the walkers' one rule (ckpt.read.chain)
        except ChainLoopError:
            raise CorruptCheckpointError(f"{self.path}: the delta chain through {name} loops",
                                         path=str(self.path), file=MANIFEST_NAME) from None
        try:
            if path.storage.is_link(path.path):
                raise InvalidManifestError(f"{path} is a symbolic link; a base must be a sibling checkpoint")
            return ChunkSource(path, mirrors=self.mirrors, _seen=self._seen + (identity,))
        except CheckpointError as exc:
            return CorruptCheckpointError(
                f"delta chain broken: {self.path.name} needs its base {name}, which cannot be opened ({exc})",
                path=str(path), file=exc.file)

    # -- values ------------------------------------------------------------------------------
    def value(self, key: str, entry: ValueEntry) -> Any:
        """A non-tensor value, decoded without ever running code from the checkpoint."""
        if entry.encoding == "json":
            try:
                return values.decode(entry.value)
            except RecursionError:
                raise InvalidManifestError(f"{self.path}: value {key!r} is nested too deeply", path=self.path,
                                           file=MANIFEST_NAME, tensor=key) from None
            except CheckpointError as exc:
                exc.path, exc.file, exc.tensor = str(self.path), MANIFEST_NAME, key
                raise
        raw = self.files.read(entry.blob, what=key)
        try:
            return torch.load(io.BytesIO(bytes(raw)), weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpointError(
                f"{self.path}: value {key!r} cannot be loaded without executing code from the checkpoint "
                f"({type(exc).__name__}); refused", path=self.path, file=entry.blob.file, tensor=key
            ) from None

    def close(self) -> None:
        self.files.close()
        for source in self._bases or ():
            if isinstance(source, ChunkSource):
                source.close()

    def __enter__(self) -> "ChunkSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

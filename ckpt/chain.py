"""Opening committed checkpoints and reading any chunk's raw bytes, replaying delta chains.

A delta checkpoint names its base (a sibling directory); a chunk stored as ``delta`` or
``unchanged`` is decoded against the same chunk of the base, which may itself be a delta, down to
the last full checkpoint. Every link's bytes are checksum-verified; a missing, corrupt or looping
link raises :class:`~ckpt.errors.CorruptCheckpointError` naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import codec, commit
from .datafile import DataFiles
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, InvalidManifestError
from .format import MANIFEST_NAME, Chunk, Manifest

MAX_MANIFEST_BYTES = 1 << 30
MAX_CHAIN = 100_000


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse and validate the manifest of the committed checkpoint at ``path``."""
    path = Path(path)
    if commit.TMP_MARK in path.name or commit.OLD_MARK in path.name:
        raise CheckpointNotFoundError(f"{path} is the leftover of an unfinished save, not a checkpoint")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at {path}")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointNotFoundError(f"{path} is not a committed checkpoint (no {MANIFEST_NAME})")
    if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise InvalidManifestError(f"{manifest_path} is absurdly large", file=MANIFEST_NAME)
    return Manifest.from_json(manifest_path.read_bytes(), source=str(manifest_path))


class ChunkSource:
    """Verified, decoded chunk bytes of one checkpoint (and, through it, of its chain)."""

    def __init__(self, path: str | os.PathLike, manifest: Manifest | None = None, *, _seen: tuple = ()):
        self.path = Path(path)
        self.manifest = manifest if manifest is not None else read_manifest(self.path)
        self.files = DataFiles(self.path)
        self._seen = _seen + (self.path.resolve(),)
        self._base: ChunkSource | None = None

    def base(self) -> "ChunkSource":
        """The base checkpoint of this delta, opened on first use."""
        if self._base is None:
            name = self.manifest.base
            if name is None:
                raise CorruptCheckpointError(f"{self.path} stores delta chunks but names no base")
            path = self.path.parent / name
            if path.resolve() in self._seen or len(self._seen) >= MAX_CHAIN:
                raise CorruptCheckpointError(f"{self.path}: the delta chain through {name} loops")
            try:
                self._base = ChunkSource(path, _seen=self._seen)
            except CheckpointError as exc:
                raise CorruptCheckpointError(
                    f"delta chain broken: {self.path.name} needs its base {name}, which cannot be opened ({exc})",
                    file=name) from None
        return self._base

    def raw(self, key: str, chunk: Chunk, itemsize: int) -> np.ndarray:
        """The chunk's raw bytes (a uint8 array), verified and decoded."""
        blob = chunk.blob
        what = f"{key} in {self.path.name}"
        stored = self.files.read(blob, what=what) if blob.length else b""
        base = None
        if blob.codec in codec.NEEDS_BASE:
            source = self.base()
            base_chunk = source.find(key, chunk.offsets, chunk.sizes)
            if base_chunk is None:
                raise CorruptCheckpointError(
                    f"delta chain broken: {what} has no matching chunk in its base {source.path.name}",
                    file=source.path.name, tensor=key)
            base = source.raw(key, base_chunk, itemsize)
        return codec.decode(blob.codec, stored, raw_length=blob.decoded_length, itemsize=itemsize,
                            planes=blob.planes, base=base, what=what)

    def find(self, key: str, offsets: tuple, sizes: tuple) -> Chunk | None:
        entry = self.manifest.tensors.get(key)
        if entry is None:
            return None
        for chunk in entry.chunks:
            if chunk.offsets == offsets and chunk.sizes == sizes:
                return chunk
        return None

    def chain(self) -> list[Path]:
        """This checkpoint and every base it depends on, newest first."""
        links, source = [self.path], self
        while source.manifest.base is not None:
            source = source.base()
            links.append(source.path)
        return links

    def close(self) -> None:
        self.files.close()
        if self._base is not None:
            self._base.close()

    def __enter__(self) -> "ChunkSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The manifest (format version 3, specified in docs/FORMAT.md): the type and its serialisation.

A checkpoint is a directory holding ``manifest.json`` and ``data/<file>.bin``. The manifest is the
only metadata: DCP's ``Metadata`` is rebuilt from it (never unpickled). :class:`Manifest` is built
by the writer record by record (:meth:`Manifest.add_record`) and serialised with
:meth:`Manifest.to_json`, sealed with a digest of every other byte of the file
(:mod:`ckpt.format.digest`); :meth:`Manifest.from_json` (:func:`parse_manifest`) checks the digest
first, then parses and validates every field (:mod:`ckpt.format.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .blobs import CHECKSUM_ALGORITHM, checksum
from .digest import seal, unseal
from .entries import FORMAT_NAME, FORMAT_VERSION, Blob, Chunk, TensorEntry, ValueEntry, dtype_name
from .names import MANIFEST_NAME
from .validate import manifest_fields

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


@dataclass
class Manifest:
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    values: dict[str, ValueEntry] = field(default_factory=dict)
    paths: dict[str, tuple] = field(default_factory=dict)  # flat key -> nested path (DCP mapping)
    files: dict[str, int] = field(default_factory=dict)  # data file -> size in bytes
    step: int | None = None
    kind: str = "full"
    base_step: int | None = None
    base: str | None = None  # a delta's base checkpoint: a sibling directory name
    world_size: int = 1
    created: float = 0.0
    dcp_version: str | None = None
    user: dict = field(default_factory=dict)
    run: str | None = None  # the run that wrote it (optional: absent before runs were identified)
    # the digest of manifest.json as read (:mod:`ckpt.format.digest`; a version-1 file's own xxh3),
    # None for one built here: :meth:`identity`
    digest: str | None = field(default=None, compare=False, repr=False)

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "checksum": CHECKSUM_ALGORITHM,
            "kind": self.kind,
            "step": self.step,
            "base_step": self.base_step,
            "base": self.base,
            "world_size": self.world_size,
            "created": self.created,
            "dcp_version": self.dcp_version,
            "user": self.user,
            **({"run": self.run} if self.run is not None else {}),
            "files": dict(sorted(self.files.items())),
            "tensors": {
                key: {
                    "dtype": dtype_name(entry.dtype),
                    "shape": list(entry.shape),
                    "chunks": [
                        {"offsets": list(c.offsets), "sizes": list(c.sizes), **_blob_doc(c.blob)}
                        for c in entry.chunks
                    ],
                }
                for key, entry in sorted(self.tensors.items())
            },
            "values": {
                key: (
                    {"encoding": "json", "value": entry.value}
                    if entry.encoding == "json"
                    else {"encoding": entry.encoding, **_blob_doc(entry.blob)}
                )
                for key, entry in sorted(self.values.items())
            },
            "paths": {key: list(path) for key, path in sorted(self.paths.items())},
        }
        return seal(doc)

    @classmethod
    def from_json(cls, raw: bytes, *, source: str = MANIFEST_NAME) -> "Manifest":
        """Parse and validate a manifest (see :mod:`ckpt.format.validate`); ``source`` names it in errors."""
        manifest = cls(**manifest_fields(raw, source=source))
        manifest.digest = unseal(raw[-64:])[1] or checksum(raw)  # the sealed tail: no second pass over it all
        return manifest

    def identity(self) -> str:
        """The digest that tells this manifest from any other (ranks of one load compare it): the
        one read with it, else that of its serialisation (the one :meth:`to_json` seals in)."""
        if self.digest is None:
            self.digest = unseal(self.to_json())[1]
        return self.digest

    # -- assembly ------------------------------------------------------------------------------
    def add_record(self, key: str, record: "Chunk | ValueEntry") -> None:
        """Place one written record (a chunk of a declared tensor, or a value); account its file."""
        if isinstance(record, Chunk):
            self.tensors[key].chunks.append(record)
        else:
            self.values[key] = record
        if record.blob is not None:
            blob = record.blob
            self.files[blob.file] = max(self.files.get(blob.file, 0), blob.end)

    def sort_chunks(self) -> None:
        """Chunks in offset order (records arrive in the order ranks and files wrote them)."""
        for entry in self.tensors.values():
            entry.chunks.sort(key=lambda c: c.offsets)

    # -- DCP view ------------------------------------------------------------------------------
    def to_dcp_metadata(self) -> Metadata:
        # imported here: torch.distributed.checkpoint's package pulls its planners and DTensor (~1.3 s of
        # CPU), which a reader of manifests alone (ckpt-inspect) never needs (tests/test_import_cost.py)
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        sd_meta: dict[str, Any] = {}
        storage: dict[MetadataIndex, Any] = {}
        for key, entry in self.tensors.items():
            sd_meta[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=entry.dtype),
                size=torch.Size(entry.shape),
                chunks=[ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in entry.chunks],
            )
            for chunk in entry.chunks:
                storage[MetadataIndex(key, chunk.offsets)] = chunk
        for key, entry in self.values.items():
            sd_meta[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = entry
        return Metadata(
            state_dict_metadata=sd_meta,
            planner_data=dict(self.paths),
            storage_data=storage,
            version=self.dcp_version,
        )

    def blobs(self) -> Iterator[tuple[str, Blob]]:
        """``(key, blob)`` for every stored run of bytes: tensor chunks (keys in order, chunks as
        listed), then values stored as a blob (keys in order)."""
        for key, entry in sorted(self.tensors.items()):
            for chunk in entry.chunks:
                yield key, chunk.blob
        for key, value in sorted(self.values.items()):
            if value.blob is not None:
                yield key, value.blob

    def data_files(self) -> set[str]:
        """Names of the data files the manifest references (a set: no need for :meth:`blobs`' order;
        asked several times per memory save and partner copy)."""
        files = {chunk.blob.file for entry in self.tensors.values() for chunk in entry.chunks}
        files.update(value.blob.file for value in self.values.values() if value.blob is not None)
        return files

    def total_tensor_bytes(self) -> int:
        return sum(c.blob.length for e in self.tensors.values() for c in e.chunks)


def _blob_doc(blob: Blob) -> dict:
    doc = {"file": blob.file, "offset": blob.offset, "length": blob.length, "codec": blob.codec,
           "checksum": blob.checksum}
    if blob.raw_length is not None:
        doc["raw_length"] = blob.raw_length
    if blob.planes is not None:
        doc["planes"] = [list(p) for p in blob.planes]
    if blob.block_size is not None:
        doc["block_size"], doc["block_table"] = blob.block_size, blob.block_table
    return doc


def parse_manifest(raw: bytes, *, source: str = MANIFEST_NAME) -> Manifest:
    """The validated manifest in ``raw`` (:meth:`Manifest.from_json`)."""
    return Manifest.from_json(raw, source=source)

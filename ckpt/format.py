"""The on-disk format, version 1 (specified in docs/FORMAT.md): its types and their serialisation.

A checkpoint is a directory holding ``manifest.json`` and ``data/<file>.bin``. The manifest is the
only metadata: DCP's ``Metadata`` is rebuilt from it (never unpickled). :class:`Manifest` is built
by the writer record by record (:meth:`Manifest.add_record`) and serialised with
:meth:`Manifest.to_json`, sealed with a digest of every other byte of the file (:func:`seal`);
:meth:`Manifest.from_json` checks the digest first, then parses and validates (:mod:`ckpt.validate`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .blobs import checksum
from .errors import UnsupportedFormatError

FORMAT_NAME = "ckpt"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: no manifest digest (read as is); 2: every manifest byte digested
MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
CHECKSUM_ALGORITHM = "xxh3-64"
KINDS = ("full", "delta")

# Upper bounds that no real checkpoint reaches; a manifest beyond them is hostile or broken.
MAX_BYTES = 1 << 50  # 1 PiB in one file or one chunk
MAX_DIMS = 64

_DATA_FILE = re.compile(r"^data/[A-Za-z0-9][A-Za-z0-9._-]{0,127}\.bin$")
_CHECKSUM = re.compile(r"^[0-9a-f]{16}$")
_SIBLING = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # one path component, no "..", no "/"


_DIGEST_TAIL = re.compile(rb',"digest":"([0-9a-f]{16})"\}\Z')


def seal(doc: dict) -> bytes:
    """``doc`` as compact JSON bytes with one last field, ``"digest"``: the xxh3-64 of the same
    bytes without that field (the document as it reads up to its closing brace)."""
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if not doc:
        raise ValueError("an empty manifest cannot be sealed")
    return body[:-1] + b',"digest":"' + checksum(body).encode() + b'"}'


def unseal(raw: bytes) -> tuple[bytes, str | None, str | None]:
    """``(body, stored digest, digest of body)``: the sealed document without its digest field,
    or ``(raw, None, None)`` when it has none (a version-1 manifest, or a damaged tail)."""
    tail = _DIGEST_TAIL.search(raw)
    if tail is None:
        return raw, None, None
    body = raw[: tail.start()] + b"}"
    return body, tail.group(1).decode(), checksum(body)


def is_data_file_name(name: Any) -> bool:
    return isinstance(name, str) and _DATA_FILE.fullmatch(name) is not None


def is_checksum(text: Any) -> bool:
    return isinstance(text, str) and _CHECKSUM.fullmatch(text) is not None


def is_sibling_name(name: Any) -> bool:
    """A delta's base: one path component beside the checkpoint (no "..", no separators)."""
    return isinstance(name, str) and _SIBLING.fullmatch(name) is not None

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedFormatError(f"dtype {dtype} cannot be stored") from None


def data_file_name(rank: int, part: int = 0, tag: str = "") -> str:
    """Relative name of a rank's data file: ``data/rank-00003.bin`` (``-p1`` etc. for extra parts;
    on object stores prefixed by the save attempt's tag: ``data/<tag>.rank-00003.bin``)."""
    return f"{DATA_DIR}/" + (f"{tag}." if tag else "") + f"rank-{rank:05d}" + (f"-p{part}" if part else "") + ".bin"


@dataclass(frozen=True)
class Blob:
    """Where a run of stored bytes lives and how to verify and decode it."""

    file: str
    offset: int
    length: int  # bytes stored in the file
    checksum: str  # xxh3-64 of the stored bytes, 16 hex digits
    codec: str = "raw"
    raw_length: int | None = None  # bytes after decoding; equals length for "raw"
    planes: tuple[tuple[str, int], ...] | None = None  # codecs "planes"/"delta": [plane codec, length]

    @property
    def decoded_length(self) -> int:
        return self.length if self.raw_length is None else self.raw_length


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: global ``offsets`` and ``sizes``, bytes in ``blob``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    blob: Blob


@dataclass
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[Chunk]


@dataclass
class ValueEntry:
    """A non-tensor value: inline tagged JSON, or a ``torch.save`` stream read with weights_only."""

    encoding: str  # "json" | "torch_save"
    value: Any = None  # the tagged-JSON form, for "json"
    blob: Blob | None = None  # for "torch_save"


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
        """Parse and validate a manifest (see :mod:`ckpt.validate`)."""
        from .validate import parse_manifest  # validation needs these types: imported when used

        return parse_manifest(raw, source=source)

    # -- assembly ------------------------------------------------------------------------------
    def add_record(self, key: str, record: "Chunk | ValueEntry") -> None:
        """Place one written record (a chunk of a declared tensor, or a value); account its file."""
        if isinstance(record, Chunk):
            self.tensors[key].chunks.append(record)
        else:
            self.values[key] = record
        if record.blob is not None:
            blob = record.blob
            self.files[blob.file] = max(self.files.get(blob.file, 0), blob.offset + blob.length)

    def sort_chunks(self) -> None:
        """Chunks in offset order (records arrive in the order ranks and files wrote them)."""
        for entry in self.tensors.values():
            entry.chunks.sort(key=lambda c: c.offsets)

    # -- DCP view ------------------------------------------------------------------------------
    def to_dcp_metadata(self) -> Metadata:
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

    def data_files(self) -> set[str]:
        """Names of the data files the manifest references."""
        files = {c.blob.file for entry in self.tensors.values() for c in entry.chunks}
        return files | {v.blob.file for v in self.values.values() if v.blob is not None}

    def total_tensor_bytes(self) -> int:
        return sum(c.blob.length for e in self.tensors.values() for c in e.chunks)


def _blob_doc(blob: Blob) -> dict:
    doc = {"file": blob.file, "offset": blob.offset, "length": blob.length, "codec": blob.codec,
           "checksum": blob.checksum}
    if blob.raw_length is not None:
        doc["raw_length"] = blob.raw_length
    if blob.planes is not None:
        doc["planes"] = [list(p) for p in blob.planes]
    return doc

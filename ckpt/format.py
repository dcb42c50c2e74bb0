"""The on-disk format, version 1 (specified in docs/FORMAT.md).

A checkpoint is a directory holding ``manifest.json`` and ``data/<file>.bin``. The manifest is the
only metadata: DCP's ``Metadata`` is rebuilt from it (never unpickled), and every name, size and
offset in it is validated before a single data byte is read, so a hostile manifest cannot make a
reader touch anything outside the checkpoint or allocate absurd buffers.
"""

from __future__ import annotations

import json
import math
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

from .codec import CODECS, DELTA, PLANE_CODECS, PLANES, UNCHANGED
from .errors import InvalidManifestError, UnsupportedFormatError

FORMAT_NAME = "ckpt"
FORMAT_VERSION = 1
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


def data_file_name(rank: int, part: int = 0) -> str:
    """Relative name of a rank's data file: ``data/rank-00003.bin`` (``-p1`` etc. for extra parts)."""
    return f"{DATA_DIR}/rank-{rank:05d}" + (f"-p{part}" if part else "") + ".bin"


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
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, source: str = MANIFEST_NAME) -> "Manifest":
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidManifestError(f"{source}: not valid JSON ({exc})", file=source) from None
        try:
            return _parse(doc)
        except InvalidManifestError as exc:
            raise InvalidManifestError(f"{source}: {exc}", file=source) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidManifestError(f"{source}: malformed ({type(exc).__name__}: {exc})", file=source) from None

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


# -- parsing and validation -------------------------------------------------------------------

def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidManifestError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise InvalidManifestError(f"{what} must be a list of at most {MAX_DIMS} integers")
    return tuple(_int(v, what) for v in value)


def _blob(doc: dict, where: str) -> Blob:
    name = doc["file"]
    if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
        raise InvalidManifestError(f"{where}: illegal data file name {name!r}")
    checksum = doc["checksum"]
    if not isinstance(checksum, str) or not _CHECKSUM.match(checksum):
        raise InvalidManifestError(f"{where}: malformed checksum {checksum!r}")
    codec = doc.get("codec", "raw")
    if codec not in CODECS:
        raise UnsupportedFormatError(f"{where}: unknown codec {codec!r}")
    raw_length = doc.get("raw_length")
    length = _int(doc["length"], f"{where}: length")
    planes = None
    if codec in (PLANES, DELTA):
        table = doc["planes"]
        if not isinstance(table, list) or not 1 <= len(table) <= 8:
            raise InvalidManifestError(f"{where}: a plane table of 1 to 8 planes is required")
        planes = tuple((str(c), _int(n, f"{where}: plane length")) for c, n in table)
        if any(c not in PLANE_CODECS for c, _ in planes) or sum(n for _, n in planes) != length:
            raise InvalidManifestError(f"{where}: plane table does not match the stored length")
    elif codec == UNCHANGED and length != 0:
        raise InvalidManifestError(f"{where}: an unchanged chunk stores no bytes")
    return Blob(
        file=name,
        offset=_int(doc["offset"], f"{where}: offset"),
        length=length,
        checksum=checksum,
        codec=codec,
        raw_length=None if raw_length is None else _int(raw_length, f"{where}: raw_length"),
        planes=planes,
    )


def _check_coverage(key: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """Chunks must tile the tensor: distinct origins whose volumes add up to the whole (each one
    already lies inside the shape), so no element can silently keep a stale live value."""
    if len({c.offsets for c in chunks}) != len(chunks):
        raise InvalidManifestError(f"tensor {key!r}: two chunks share an origin")
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
        raise InvalidManifestError(f"tensor {key!r}: chunks do not cover its shape {list(shape)}")


def _parse(doc: Any) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise InvalidManifestError("not a checkpoint manifest of this format")
    version = doc.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidManifestError(f"bad format_version {version!r}")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"checkpoint format version {version} is newer than this build reads ({FORMAT_VERSION})"
        )
    if doc.get("checksum", CHECKSUM_ALGORITHM) != CHECKSUM_ALGORITHM:
        raise UnsupportedFormatError(f"unknown checksum algorithm {doc.get('checksum')!r}")
    kind = doc.get("kind", "full")
    if kind not in KINDS:
        raise InvalidManifestError(f"unknown kind {kind!r}")

    files = {}
    for name, size in doc.get("files", {}).items():
        if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
            raise InvalidManifestError(f"illegal data file name {name!r}")
        files[name] = _int(size, f"size of {name}")

    tensors = {}
    for key, entry in doc["tensors"].items():
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise UnsupportedFormatError(f"tensor {key!r}: unknown dtype {entry['dtype']!r}")
        shape = _dims(entry["shape"], f"tensor {key!r}: shape")
        if math.prod(shape) * dtype.itemsize > MAX_BYTES:
            raise InvalidManifestError(f"tensor {key!r}: absurd shape {list(shape)}")
        chunks = []
        for doc_chunk in entry["chunks"]:
            offsets = _dims(doc_chunk["offsets"], f"tensor {key!r}: chunk offsets")
            sizes = _dims(doc_chunk["sizes"], f"tensor {key!r}: chunk sizes")
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > d for o, s, d in zip(offsets, sizes, shape)
            ):
                raise InvalidManifestError(
                    f"tensor {key!r}: chunk at {list(offsets)} size {list(sizes)} lies outside shape {list(shape)}"
                )
            blob = _blob(doc_chunk, f"tensor {key!r}")
            expected = math.prod(sizes) * dtype.itemsize
            if blob.codec != "raw" and blob.raw_length is None:
                raise InvalidManifestError(f"tensor {key!r}: codec {blob.codec} needs raw_length")
            if blob.decoded_length != expected or (blob.codec == "raw" and blob.length != expected):
                raise InvalidManifestError(
                    f"tensor {key!r}: chunk at {list(offsets)} claims {blob.decoded_length} bytes, "
                    f"its box holds {expected}"
                )
            chunks.append(Chunk(offsets, sizes, blob))
        _check_coverage(key, shape, chunks)
        tensors[key] = TensorEntry(dtype, shape, chunks)

    values = {}
    for key, entry in doc["values"].items():
        encoding = entry["encoding"]
        if encoding == "json":
            values[key] = ValueEntry("json", value=entry["value"])
        elif encoding == "torch_save":
            values[key] = ValueEntry("torch_save", blob=_blob(entry, f"value {key!r}"))
        else:
            raise UnsupportedFormatError(f"value {key!r}: unknown encoding {encoding!r}")

    paths = {}
    for key, path in doc.get("paths", {}).items():
        if not isinstance(path, list) or not all(
            isinstance(p, (str, int)) and not isinstance(p, bool) for p in path
        ):
            raise InvalidManifestError(f"path of {key!r} must be a list of str/int")
        paths[key] = tuple(path)

    step, base = doc.get("step"), doc.get("base_step")
    base_dir = doc.get("base")
    if base_dir is not None and (not isinstance(base_dir, str) or not _SIBLING.fullmatch(base_dir)):
        raise InvalidManifestError(f"illegal base checkpoint name {base_dir!r}")
    if kind == "delta" and base_dir is None:
        raise InvalidManifestError("a delta checkpoint must name its base")
    return Manifest(
        tensors=tensors,
        values=values,
        paths=paths,
        files=files,
        step=None if step is None else _int(step, "step", hi=1 << 62),
        kind=kind,
        base_step=None if base is None else _int(base, "base_step", hi=1 << 62),
        base=base_dir,
        world_size=_int(doc.get("world_size", 1), "world_size", lo=1, hi=1 << 24),
        created=float(doc.get("created", 0.0)),
        dcp_version=doc.get("dcp_version") if isinstance(doc.get("dcp_version"), str) else None,
        user=doc.get("user") if isinstance(doc.get("user"), dict) else {},
    )

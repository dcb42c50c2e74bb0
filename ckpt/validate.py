"""Parsing and validating a manifest: nothing in it is trusted before it passes here.

Every name, size, offset, codec and plane table is checked before a single data byte is read, so a
hostile manifest cannot make a reader touch anything outside the checkpoint, allocate absurd
buffers or leave an element of a tensor unloaded (chunks must tile each tensor). Failures are
:class:`~ckpt.errors.InvalidManifestError` (malformed or hostile) or
:class:`~ckpt.errors.UnsupportedFormatError` (a newer version, an unknown codec or dtype).
"""

from __future__ import annotations

import json
import math
from typing import Any

from .codec import CODECS, DELTA, PLANE_CODECS, PLANES, UNCHANGED
from .errors import InvalidManifestError, UnsupportedFormatError
from .format import (
    CHECKSUM_ALGORITHM,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    KINDS,
    MANIFEST_NAME,
    MAX_BYTES,
    MAX_DIMS,
    Blob,
    Chunk,
    Manifest,
    TensorEntry,
    ValueEntry,
    is_checksum,
    is_data_file_name,
    is_sibling_name,
)


def parse_manifest(raw: bytes, *, source: str = MANIFEST_NAME) -> Manifest:
    """The validated manifest in ``raw`` (``source`` names it in errors)."""
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
    if not is_data_file_name(name):
        raise InvalidManifestError(f"{where}: illegal data file name {name!r}")
    checksum = doc["checksum"]
    if not is_checksum(checksum):
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
        if not is_data_file_name(name):
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
    if base_dir is not None and not is_sibling_name(base_dir):
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

"""Parsing and validating a manifest: nothing in it is trusted before it passes here.

1. The digest (format version 2 and later): the xxh3-64 of the file's bytes without the trailing
   ``"digest"`` field must match it, before the JSON is even parsed; a mismatch, or a version-2
   manifest without one, is a :class:`~ckpt.errors.CorruptCheckpointError` naming the manifest.
   Version-1 manifests (written before the digest existed) are read without one.
2. Every field is required (none defaults silently: a missing ``codec`` is an error, not "raw"),
   and every name, size, offset, codec and plane table is checked before a single data byte is
   read, so a hostile manifest cannot make a reader touch anything outside the checkpoint,
   allocate absurd buffers or leave an element of a tensor unloaded (chunks must tile each tensor).
   A version-3 blob's block fields (:mod:`ckpt.format.blocks`) are checked too: a power-of-two
   block size in [64 KiB, 64 MiB] (so a table holds at most one 8-byte entry per 64 KiB of bytes
   already bounded by the file's size), a blob longer than one block, and a table offset inside the
   limits; block fields in an older version's manifest are refused.

:func:`manifest_fields` returns the checked fields as the keyword arguments of
:class:`~ckpt.format.manifest.Manifest`, which builds itself from them (:meth:`Manifest.from_json`):
this module sits below the manifest type and needs only its entries.

Failures are :class:`~ckpt.errors.InvalidManifestError` (malformed or hostile, incl. JSON nested
too deep or numbers too long to parse) or :class:`~ckpt.errors.UnsupportedFormatError` (a newer
version, an unknown codec or dtype), both naming the manifest.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import CorruptCheckpointError, InvalidManifestError, UnsupportedFormatError
from .blobs import CHECKSUM_ALGORITHM, is_checksum
from .blocks import is_block_size
from .codec import CODECS, DELTA, PLANE_CODECS, PLANES, RAW, UNCHANGED
from .digest import unseal
from .entries import (
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    KINDS,
    MAX_BYTES,
    MAX_DIMS,
    READABLE_VERSIONS,
    Blob,
    Chunk,
    TensorEntry,
    ValueEntry,
)
from .names import MANIFEST_NAME, is_data_file_name, is_run_id, is_sibling_name


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON (FORMAT.md: no NaN/Infinity literals)")


def manifest_fields(raw: bytes, *, source: str = MANIFEST_NAME) -> dict[str, Any]:
    """The validated fields of the manifest in ``raw`` (``source`` names it in errors): the keyword
    arguments of :class:`~ckpt.format.manifest.Manifest`."""
    body, stored, computed = unseal(raw)
    if stored is not None and stored != computed:
        raise CorruptCheckpointError(
            f"{source}: manifest digest mismatch (stored {stored}, computed {computed}): the manifest "
            "is damaged", file=MANIFEST_NAME)
    try:
        doc = json.loads(body, parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # incl. JSONDecodeError, huge ints
        raise InvalidManifestError(f"{source}: not valid JSON ({type(exc).__name__}: {_short(exc)})",
                                   file=MANIFEST_NAME) from None
    try:
        return _parse(doc, sealed=stored is not None)
    except (CorruptCheckpointError, UnsupportedFormatError) as exc:
        raise type(exc)(f"{source}: {exc}", file=MANIFEST_NAME) from None
    except KeyError as exc:
        raise InvalidManifestError(f"{source}: required field {exc.args[0]!r} is missing",
                                   file=MANIFEST_NAME) from None
    except (TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise InvalidManifestError(f"{source}: malformed ({type(exc).__name__}: {_short(exc)})",
                                   file=MANIFEST_NAME) from None


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "…"


# JSON gives exact types (a number is an int, a float or, for true/false, a bool), so ``type(v) is int``
# is the check: bool refused. The hot checks below run once per leaf of every manifest read (a memory
# step's partner copy: every step), so they test types directly and build an error's words only on error.

def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidManifestError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _dims(value: Any, key: str, what: str) -> tuple[int, ...]:
    """A tensor's shape or a chunk's box (``what`` of tensor ``key``): at most MAX_DIMS sizes in [0, MAX_BYTES]."""
    if type(value) is list and len(value) <= MAX_DIMS:
        for v in value:
            if type(v) is not int or not 0 <= v <= MAX_BYTES:
                _int(v, f"tensor {key!r}: {what}")
        return tuple(value)
    raise InvalidManifestError(f"tensor {key!r}: {what} must be a list of at most {MAX_DIMS} integers")


def _size(value: Any, where: str, what: str) -> int:
    """A blob's byte count or offset: :func:`_int` in [0, MAX_BYTES], named ``where: what`` on error."""
    if type(value) is int and 0 <= value <= MAX_BYTES:
        return value
    return _int(value, f"{where}: {what}")


def _blocks(doc: dict, where: str, length: int, version: int) -> tuple[int | None, int | None]:
    if "block_size" not in doc and "block_table" not in doc:
        return None, None
    if version < 3:
        raise InvalidManifestError(f"{where}: block checksums in a version-{version} manifest")
    size = doc["block_size"]
    if not is_block_size(size):
        raise InvalidManifestError(f"{where}: block_size must be a power of two in [64 KiB, 64 MiB], got {size!r}")
    if length <= size:
        raise InvalidManifestError(f"{where}: a blob of one block or less has no block fields (block_size {size})")
    table = _int(doc["block_table"], f"{where}: block_table", hi=MAX_BYTES - length // 8192 - 8)
    return size, table


def _blob(doc: dict, where: str, version: int = FORMAT_VERSION) -> Blob:
    name = doc["file"]
    if not is_data_file_name(name):
        raise InvalidManifestError(f"{where}: illegal data file name {name!r}")
    checksum = doc["checksum"]
    if not is_checksum(checksum):
        raise InvalidManifestError(f"{where}: malformed checksum {checksum!r}")
    codec = doc["codec"]
    if codec not in CODECS:
        raise UnsupportedFormatError(f"{where}: unknown codec {codec!r}")
    raw_length = doc["raw_length"] if codec != RAW else doc.get("raw_length")
    length = _size(doc["length"], where, "length")
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
    block_size, block_table = _blocks(doc, where, length, version)
    return Blob(
        file=name,
        offset=_size(doc["offset"], where, "offset"),
        length=length,
        checksum=checksum,
        codec=codec,
        raw_length=None if raw_length is None else _size(raw_length, where, "raw_length"),
        planes=planes,
        block_size=block_size,
        block_table=block_table,
    )


def _check_coverage(key: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """Chunks must tile the tensor: distinct origins whose volumes add up to the whole (each one
    already lies inside the shape), so no element can silently keep a stale live value."""
    if len(chunks) > 1 and len({c.offsets for c in chunks}) != len(chunks):
        raise InvalidManifestError(f"tensor {key!r}: two chunks share an origin")
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
        raise InvalidManifestError(f"tensor {key!r}: chunks do not cover its shape {list(shape)}")


def _parse(doc: Any, *, sealed: bool) -> dict[str, Any]:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise InvalidManifestError("not a checkpoint manifest of this format")
    version = doc["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise InvalidManifestError(f"bad format_version {version!r}")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"checkpoint format version {version} is newer than this build reads ({FORMAT_VERSION})"
        )
    if version not in READABLE_VERSIONS:
        raise UnsupportedFormatError(f"checkpoint format version {version} cannot be read")
    if version >= 2 and not sealed:
        raise CorruptCheckpointError("the manifest's digest is missing or damaged", file=MANIFEST_NAME)
    if doc["checksum"] != CHECKSUM_ALGORITHM:
        raise UnsupportedFormatError(f"unknown checksum algorithm {doc['checksum']!r}")
    kind = doc["kind"]
    if kind not in KINDS:
        raise InvalidManifestError(f"unknown kind {kind!r}")

    files = {}
    for name, size in _mapping(doc["files"], "files").items():
        if not is_data_file_name(name):
            raise InvalidManifestError(f"illegal data file name {name!r}")
        files[name] = _int(size, f"size of {name}")

    tensors = {}
    for key, entry in _mapping(doc["tensors"], "tensors").items():
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise UnsupportedFormatError(f"tensor {key!r}: unknown dtype {entry['dtype']!r}")
        shape = _dims(entry["shape"], key, "shape")
        if math.prod(shape) * dtype.itemsize > MAX_BYTES:
            raise InvalidManifestError(f"tensor {key!r}: absurd shape {list(shape)}")
        chunks, origin = [], (0,) * len(shape)
        for doc_chunk in entry["chunks"]:
            offsets = _dims(doc_chunk["offsets"], key, "chunk offsets")
            sizes = _dims(doc_chunk["sizes"], key, "chunk sizes")
            whole = sizes == shape and offsets == origin  # the common case, inside by definition
            if not whole and (len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > d for o, s, d in zip(offsets, sizes, shape)
            )):
                raise InvalidManifestError(
                    f"tensor {key!r}: chunk at {list(offsets)} size {list(sizes)} lies outside shape {list(shape)}"
                )
            blob = _blob(doc_chunk, f"tensor {key!r}", version)
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
    for key, entry in _mapping(doc["values"], "values").items():
        encoding = entry["encoding"]
        if encoding == "json":
            values[key] = ValueEntry("json", value=entry["value"])
        elif encoding == "torch_save":
            values[key] = ValueEntry("torch_save", blob=_blob(entry, f"value {key!r}", version))
        else:
            raise UnsupportedFormatError(f"value {key!r}: unknown encoding {encoding!r}")

    paths = {}
    for key, path in _mapping(doc["paths"], "paths").items():
        if type(path) is not list:
            raise InvalidManifestError(f"path of {key!r} must be a list of str/int")
        for part in path:
            if type(part) is not str and type(part) is not int:  # a bool is neither
                raise InvalidManifestError(f"path of {key!r} must be a list of str/int")
        paths[key] = tuple(path)

    step, base = doc["step"], doc["base_step"]
    base_dir = doc["base"]
    if base_dir is not None and not is_sibling_name(base_dir):
        raise InvalidManifestError(f"illegal base checkpoint name {base_dir!r}")
    if (kind == "delta") != (base_dir is not None) or (base_dir is None) != (base is None):
        raise InvalidManifestError("a delta checkpoint, and only a delta, names its base and base step")
    created, dcp_version, user = doc["created"], doc["dcp_version"], doc["user"]
    run = doc.get("run")  # optional (FORMAT.md): a run identity, absent in older manifests
    if run is not None and not is_run_id(run):
        raise InvalidManifestError(f"run must be a run identity (1 to 64 of [A-Za-z0-9._-]) or absent, got {run!r}")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise InvalidManifestError(f"created must be a time in seconds, got {created!r}")
    if dcp_version is not None and not isinstance(dcp_version, str):
        raise InvalidManifestError(f"dcp_version must be a string or null, got {dcp_version!r}")
    return dict(
        tensors=tensors,
        values=values,
        paths=paths,
        files=files,
        step=None if step is None else _int(step, "step", hi=1 << 62),
        kind=kind,
        base_step=None if base is None else _int(base, "base_step", hi=1 << 62),
        base=base_dir,
        world_size=_int(doc["world_size"], "world_size", lo=1, hi=1 << 24),
        created=float(created),
        dcp_version=dcp_version,
        user=_mapping(user, "user"),
        run=run,
    )


def _mapping(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidManifestError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value

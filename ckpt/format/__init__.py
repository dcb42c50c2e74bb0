"""The spec in code (docs/FORMAT.md): what a checkpoint holds and how its bytes read back.

Imports nothing above it (only :mod:`ckpt.errors`); everything else in the engine builds on it.

    names      every directory and file name of a checkpoint, and its parser
    blobs      a blob's checksum (xxh3-64) and alignment
    digest     the manifest's digest (seal / unseal)
    entries    the vocabulary: format version, kinds, limits, dtypes; Blob, Chunk, TensorEntry, ValueEntry
    validate   a manifest's JSON checked field by field before anything in it is used
    manifest   :class:`Manifest`: assembled, serialised, parsed (through validate), listed
    codec      chunk codecs: raw, planes, delta, unchanged
    values     non-tensor values as tagged JSON

The names most callers need are importable from here (``from ckpt.format import Manifest, Chunk``).
"""

from . import codec
from .blobs import CHECKSUM_ALGORITHM, checksum, is_checksum
from .digest import seal, unseal
from .entries import (
    DTYPE_NAMES,
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
    dtype_name,
)
from .manifest import Manifest, parse_manifest
from .names import (
    DAMAGED_MARK,
    DATA_DIR,
    MANIFEST_NAME,
    OLD_MARK,
    TMP_MARK,
    aside_name,
    attempt_name,
    damaged_name,
    data_file_name,
    data_file_rank,
    is_data_file_name,
    is_leftover,
    is_run_id,
    is_sibling_name,
    leftover_target,
    numbered_file_name,
    parse_damaged_name,
    parse_step_name,
    step_name,
    step_of_entry,
)

__all__ = [
    "codec", "CHECKSUM_ALGORITHM", "checksum", "is_checksum", "seal", "unseal",
    "DTYPE_NAMES", "DTYPES", "FORMAT_NAME", "FORMAT_VERSION", "KINDS", "MAX_BYTES", "MAX_DIMS", "READABLE_VERSIONS",
    "Blob", "Chunk", "TensorEntry", "ValueEntry", "dtype_name", "Manifest", "parse_manifest",
    "DAMAGED_MARK", "DATA_DIR", "MANIFEST_NAME", "OLD_MARK", "TMP_MARK", "aside_name", "attempt_name", "damaged_name", "data_file_name",
    "data_file_rank", "is_data_file_name", "is_leftover", "is_run_id", "is_sibling_name", "leftover_target", "numbered_file_name", "parse_damaged_name",
    "parse_step_name", "step_name", "step_of_entry",
]

"""A committed checkpoint at a location: whether there is one (and why not), and its manifest.

The reader's side of the commit protocol (:mod:`ckpt.commit`): a checkpoint directory is committed
exactly when it holds ``manifest.json``; a leftover of an unfinished save (``<name>.tmp-<id>``,
``<name>.old-<id>``) never is. :func:`read_manifest` opens a committed checkpoint and validates its
manifest before anything in it is used (:mod:`ckpt.format.validate`); a directory that DCP wrote
instead is recognised (:func:`looks_like_dcp`) so that the refusal says how to convert it (its
``.metadata`` is read, bounded like a manifest, by :func:`read_metadata_file`).

Below both the commit protocol and the read side, which share it; it imports only the spec and the
storage seam.
"""

from __future__ import annotations

import os

from .gc_pause import paused_gc
from ..errors import CheckpointError, CheckpointNotFoundError, InvalidManifestError
from ..format import MANIFEST_NAME, Manifest, is_leftover
from ..storage import Location, locate

MAX_MANIFEST_BYTES = 1 << 30
# A plain DCP checkpoint (FileSystemWriter): a ``.metadata`` pickle beside ``*.distcp`` data files.
DCP_METADATA_NAME = ".metadata"
DCP_DATA_SUFFIX = ".distcp"


def uncommitted_reason(path: Location) -> str | None:
    """Why ``path`` is not a committed checkpoint directory (None when it is one)."""
    if is_leftover(path.name):
        return f"{path} is the leftover of an unfinished save, not a checkpoint"
    if (path / MANIFEST_NAME).is_file():
        return None
    if not path.is_dir():
        return f"no checkpoint at {path}"
    return f"{path} is not a committed checkpoint (no {MANIFEST_NAME})"


def is_committed(path: Location) -> bool:
    return uncommitted_reason(path) is None


def looks_like_dcp(path: Location) -> bool:
    """Whether ``path`` is a directory written by DCP's FileSystemWriter (a ``.metadata`` file and
    ``*.distcp`` data files beside it)."""
    try:
        return (path / DCP_METADATA_NAME).is_file() and any(n.endswith(DCP_DATA_SUFFIX) for n in path.list())
    except (OSError, CheckpointError):
        return False


def read_metadata_file(path: Location, name: str, limit: int, error: type[CheckpointError]) -> bytes:
    """The bytes of the metadata file ``path/name`` (a manifest, DCP's ``.metadata``), read whole;
    one larger than ``limit`` bytes is refused as ``error`` (no real one comes near it)."""
    try:
        return path.storage.read_bytes(path.path, name, limit)
    except ValueError:
        raise error(f"{path / name} is absurdly large", path=str(path), file=name) from None


def read_manifest(path: str | os.PathLike | Location, storage_options: dict | None = None) -> Manifest:
    """Parse and validate the manifest of the committed checkpoint at ``path`` (a directory or a URL,
    resolved here: the door; a :class:`~ckpt.storage.Location` is used as it is)."""
    return read_manifest_bytes(locate(path, storage_options))[0]


def read_manifest_bytes(path: Location) -> tuple[Manifest, bytes]:
    """:func:`read_manifest`, also returning the manifest's bytes as stored."""
    reason = uncommitted_reason(path)
    if reason is not None:
        if path.storage.is_local and path.is_dir() and looks_like_dcp(path):
            reason = (f"{path} is a checkpoint written by torch.distributed.checkpoint (DCP), not by ckpt; "
                      f"convert it with: ckpt-convert {path} <dst> --from dcp")
        raise CheckpointNotFoundError(reason, path=str(path), file=MANIFEST_NAME)
    raw = read_metadata_file(path, MANIFEST_NAME, MAX_MANIFEST_BYTES, InvalidManifestError)
    try:
        with paused_gc():  # acyclic, and superlinear with the collector on (ckpt/read/gc_pause.py)
            return Manifest.from_json(raw, source=str(path / MANIFEST_NAME)), raw
    except CheckpointError as exc:
        exc.path = str(path)
        raise

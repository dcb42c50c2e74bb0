"""The catalog's records (the schema is in :mod:`ckpt.root.catalog.store`'s docstring): their keys, how
they are encoded and parsed back (a record that does not parse is
:class:`~ckpt.errors.CorruptCheckpointError`), what a read returns (:class:`StepInfo`,
:class:`MountState`), and how a mount is named (:func:`mount_id`). Internal to the catalog, which
re-exports the public names.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field

from ...errors import CorruptCheckpointError
from ...format import Manifest
from ...redact import redact
from ...storage import Location, is_url
from ..replica_states import ACTIVE, ReplicaState

SCHEMA_VERSION = 2  # 2: every value carries the CRC-32 of its key and body
STATES = tuple(ReplicaState)  # the replicator's states, all of them (ckpt.root.replica_states)
ACTIVE_STATES = ACTIVE  # a step is kept while some mount is in one
UNREADABLE = "unreadable manifest: "  # detail prefix of a "failed" state: listed, manifest unreadable
DIR_NAME = ".catalog"

SCHEMA_KEY, MOUNTS_KEY = b"meta/schema", b"meta/mounts"


@dataclass(frozen=True)
class MountState:
    state: ReplicaState
    when: float
    detail: str = ""


@dataclass
class StepInfo:
    """What the catalog knows of one step; ``kind`` and the sizes are None when no mount committed it."""

    step: int
    kind: str | None = None
    base_step: int | None = None
    bytes: int | None = None
    created: float | None = None
    raw_bytes: int | None = None
    tensors: int | None = None
    mounts: dict[str, MountState] = field(default_factory=dict)


def mount_id(mount: str | os.PathLike | Location) -> str:
    """The catalog's name for a mount: :attr:`Location.display_name`; a mount given as text is named
    the same way without being resolved (an absolute path, or the URL with any credentials removed)."""
    if isinstance(mount, Location):
        return mount.display_name
    text = os.fspath(mount)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if not is_url(text):
        return os.path.abspath(text)
    return redact(text).rstrip("/")  # userinfo and query values out (ckpt.redact)


def step_key(step: int) -> bytes:
    return b"step/%012d" % step


def chunks_key(step: int) -> bytes:
    return b"chunks/%012d" % step


def mount_key(mount: str, step: int) -> bytes:
    return b"mount/" + mount.encode() + b"/%012d" % step


def _crc(key: bytes, body: bytes) -> bytes:
    return b"%08x " % zlib.crc32(body, zlib.crc32(key))


def encode(key: bytes, doc) -> bytes:
    """The value stored under ``key``: the CRC-32 (8 hex digits and a space) of the key and the JSON
    body, then the body. Damage to a key or a value that still parses is found (item 15 of issue 22)."""
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return _crc(key, body) + body


def step_record(manifest: Manifest) -> dict:
    blobs = [blob for _key, blob in manifest.blobs()]
    return {"kind": manifest.kind, "base_step": manifest.base_step, "bytes": sum(b.length for b in blobs),
            "raw_bytes": sum(b.decoded_length for b in blobs), "tensors": len(manifest.tensors),
            "created": manifest.created}


def chunk_records(manifest: Manifest) -> list:
    return [[key, list(c.offsets), c.blob.file, c.blob.checksum]
            for key, entry in sorted(manifest.tensors.items()) for c in entry.chunks]


def decode(path: str, key: bytes, raw: bytes | None):
    """The JSON document stored under ``key`` (None when there is none)."""
    if raw is None:
        return None
    raw = bytes(raw)
    if raw[:9] != _crc(bytes(key), raw[9:]):
        raise CorruptCheckpointError(f"catalog {path}: record {bytes(key).decode(errors='replace')} fails its "
                                     f"checksum", path=path)
    try:
        return json.loads(raw[9:])
    except ValueError:
        raise CorruptCheckpointError(f"catalog {path}: record {key.decode(errors='replace')} is not "
                                     f"valid JSON", path=path) from None


def step_info(path: str, step: int, doc: dict | None, mounts: dict[str, MountState]) -> StepInfo:
    """A step's record and its mount states, as a read returns them."""
    if doc is None:
        return StepInfo(step, mounts=mounts)
    try:
        return StepInfo(step, kind=doc["kind"], base_step=doc["base_step"], bytes=int(doc["bytes"]),
                        created=float(doc["created"]), raw_bytes=int(doc["raw_bytes"]),
                        tensors=int(doc["tensors"]), mounts=mounts)
    except (TypeError, KeyError, ValueError):
        raise CorruptCheckpointError(f"catalog {path}: bad record for step {step}", path=path) from None


def mount_state(path: str, key: bytes, doc) -> tuple[str, int, MountState]:
    """``(mount, step, state)`` of the record ``mount/<url>/<step>``."""
    try:
        return key[len(b"mount/"):-13].decode(), int(key[-12:]), \
            MountState(ReplicaState(doc["state"]), float(doc["when"]), str(doc["detail"]))
    except (ValueError, TypeError, KeyError):
        raise CorruptCheckpointError(f"catalog {path}: bad record {key!r}", path=path) from None

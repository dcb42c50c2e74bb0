"""The catalog's records (the schema is in :mod:`ckpt.root.catalog`'s docstring): their keys, how
they are encoded and parsed back (a record that does not parse is
:class:`~ckpt.errors.CorruptCheckpointError`), what a read returns (:class:`StepInfo`,
:class:`MountState`), and how a mount is named (:func:`mount_id`). Internal to the catalog, which
re-exports the public names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from ..errors import CorruptCheckpointError
from ..format import Manifest
from ..storage import Location

SCHEMA_VERSION = 1
STATES = ("pending", "copying", "committed", "failed", "dropped", "deleted")
ACTIVE_STATES = ("pending", "copying", "committed")  # a step is kept while some mount is in one
UNREADABLE = "unreadable manifest: "  # detail prefix of a "failed" state: listed, manifest unreadable
DIR_NAME = ".catalog"

SCHEMA_KEY, MOUNTS_KEY = b"meta/schema", b"meta/mounts"


@dataclass(frozen=True)
class MountState:
    state: str
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
    """The catalog's name for a mount: its display URL, an absolute path when local, no credentials."""
    if isinstance(mount, Location):
        return os.path.abspath(mount.path) if mount.is_local else str(mount).rstrip("/")
    text = os.fspath(mount)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if "://" not in text:
        return os.path.abspath(text)
    parts = urlsplit(text)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=netloc)).rstrip("/")


def step_key(step: int) -> bytes:
    return b"step/%012d" % step


def chunks_key(step: int) -> bytes:
    return b"chunks/%012d" % step


def mount_key(mount: str, step: int) -> bytes:
    return b"mount/" + mount.encode() + b"/%012d" % step


def encode(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


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
    try:
        return json.loads(bytes(raw))
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
            MountState(doc["state"], float(doc["when"]), str(doc["detail"]))
    except (ValueError, TypeError, KeyError):
        raise CorruptCheckpointError(f"catalog {path}: bad record {key!r}", path=path) from None

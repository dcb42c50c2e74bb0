"""The read room: the load path, top to bottom.

    committed ─▶ storage_reader (DCP) ─▶ assignment/exchange ─▶ items ─▶ prefetch ─▶ source ─▶ files
                      planner (checks the live state; local_plan, rollback)    scatter, batch

| module | concept |
|---|---|
| :mod:`~ckpt.read.committed` | whether a location holds a committed checkpoint, and its manifest |
| :mod:`~ckpt.read.planner` | :class:`SafeLoadPlanner`: the live state checked against the checkpoint before a byte moves |
| :mod:`~ckpt.read.local_plan` | one rank's load plan, chunks indexed (cost linear in what the rank loads) |
| :mod:`~ckpt.read.rollback` | a failed load puts the live tensors back |
| :mod:`~ckpt.read.storage_reader` | DCP's StorageReader (:class:`ckpt.dcp.Reader`): the protocol object of a load, nothing more |
| :mod:`~ckpt.read.assignment` | replicated bytes read once, the decision: which rank reads a chunk several need |
| :mod:`~ckpt.read.exchange` | replicated bytes read once, the exchange between ranks |
| :mod:`~ckpt.read.channel` | point-to-point messages between ranks, in host memory (a gloo group or side) |
| :mod:`~ckpt.read.items` | a rank's plan read: values delivered, read order, direct targets |
| :mod:`~ckpt.read.prefetch` | several verified reads in flight per rank, in a bounded read buffer |
| :mod:`~ckpt.read.scatter` | where the bytes of a partly read chunk go (resharded loads) |
| :mod:`~ckpt.read.batch` | small chunks read together from an object store |
| :mod:`~ckpt.read.source` | :class:`ChunkSource`: read → verify → decode, delta chains included |
| :mod:`~ckpt.read.chain` | the one walker of a delta chain (:func:`walk`), bounded by :data:`MAX_CHAIN` |
| :mod:`~ckpt.read.files` | one checkpoint's data files: opened, bounded, read, verified |
| :mod:`~ckpt.read.gc_pause` | the cyclic garbage collector paused while a load builds large structures |
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .chain import MAX_CHAIN, ChainLoopError, check_link, listed_base, walk
from .committed import (
    DCP_METADATA_NAME,
    MAX_MANIFEST_BYTES,
    is_committed,
    looks_like_dcp,
    read_manifest,
    read_manifest_bytes,
    uncommitted_reason,
)
from .files import DataFiles, verify_blobs
from .prefetch import REMOTE_PIECE_BYTES, REMOTE_READ_THREADS
from .source import ChunkSource
from ..lazy import lazy_names

if TYPE_CHECKING:
    from .planner import SafeLoadPlanner
    from .storage_reader import Reader

# the DCP side of the room, imported on first use (ckpt.lazy): reading a manifest needs no DCP
__getattr__, __dir__ = lazy_names(__name__, {"SafeLoadPlanner": ".planner", "Reader": ".storage_reader"})

__all__ = ["read_manifest", "read_manifest_bytes", "is_committed", "looks_like_dcp", "uncommitted_reason",
           "MAX_MANIFEST_BYTES", "DCP_METADATA_NAME", "ChunkSource", "MAX_CHAIN", "DataFiles", "verify_blobs",
           "SafeLoadPlanner", "Reader", "REMOTE_PIECE_BYTES", "REMOTE_READ_THREADS", "walk", "listed_base",
           "check_link", "ChainLoopError"]

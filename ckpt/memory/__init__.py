"""The memory tier: every step in host RAM on its node, a copy on a partner node, recovery from
peers in seconds; storage stays the backstop (issue 38). On by ``SaveOptions(memory=...)`` (the
trainer's ``checkpoint.memory``), for the manager and every caller of the save pipeline.

| module | concept |
|---|---|
| :mod:`~ckpt.memory.store` | :class:`NodeStore`: one node's memory directory for one run (0700), its steps, complete or not |
| :mod:`~ckpt.memory.nodes` | which node a rank is on, which rank holds its partner copy |
| :mod:`~ckpt.memory.partner` | a committed rank checkpoint copied to another rank over a gloo group, verified |
| :mod:`~ckpt.memory.wire` | a partner copy's wire: frames, bounds, the file table's check, the channel |
| :mod:`~ckpt.memory.arrival` | a data file's blobs checked against its manifest while its bytes arrive |
| :mod:`~ckpt.memory.overlap` | :class:`Behind`: a stream's pieces handled on a thread, one behind the next one's read |
| :mod:`~ckpt.memory.local` | a rank's own checkpoint (its local shards), written without DCP's planner, and loaded |
| :mod:`~ckpt.memory.gate` | :class:`MemoryGate`: whether every rank takes the next memory-only save, agreed a step ahead |
| :mod:`~ckpt.memory.tier` | :class:`MemoryTier`: a save on the writer thread, one collective decision, recovery |
"""

import os

from .gate import MemoryGate
from .tier import MemoryTier


def local_world_size(world: int) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE`` (ranks are numbered node by node), else one node."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() and int(value) > 0 else world


__all__ = ["MemoryGate", "MemoryTier", "local_world_size"]

"""The states of a step on a replica mount: one enum shared by the replicator
(:mod:`ckpt.root.replicate`, which sets them), the catalog (:mod:`ckpt.root.catalog.store`, which stores
them) and ``ckpt inspect`` (:mod:`ckpt.inspect.report`, which shows them), so a state one of them knows
always reaches the others.

    pending    queued for a copy
    copying    being copied
    committed  on the mount, the primary's manifest
    failed     the last copy failed; retried with backoff (the detail says why and when)
    dropped    given up: the backlog was full, the step left the primary, or the primary's copy is corrupt
    refused    final: the mount belongs to another run (:mod:`ckpt.root.claim`); never written
    deleted    retention (or a stale copy's replacement) removed it from the mount

Members are strings (``ReplicaState.COMMITTED == "committed"``), stored and printed as their value.
``ckpt inspect`` shows two more words for a mount, never stored nor set: :data:`MISSING` (the mount
lists no such step, and the catalog knows nothing of it in flight) and :data:`UNKNOWN` (the mount
cannot be listed).
"""

from __future__ import annotations

from enum import Enum


class ReplicaState(str, Enum):
    PENDING = "pending"
    COPYING = "copying"
    COMMITTED = "committed"
    FAILED = "failed"
    DROPPED = "dropped"
    REFUSED = "refused"
    DELETED = "deleted"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


ACTIVE = (ReplicaState.PENDING, ReplicaState.COPYING, ReplicaState.COMMITTED)  # the step is kept while a mount is in one
FINAL = (ReplicaState.COMMITTED, ReplicaState.DROPPED, ReplicaState.REFUSED)  # nothing more will happen to it
MISSING, UNKNOWN = "missing", "unknown"  # shown by ckpt inspect only (see the module docstring)

"""A run's mounts: its primary root and the replicas it copies each step to.

    open_mounts(root, replicas, storage_options)   -> [primary, *replicas] (CheckpointRoot each)
    start_replicator(mounts, options, ...)         -> the Replicator of the replicas, or None

Refused up front (:class:`~ckpt.errors.InvalidOptionError`), before anything is written: replicas
that name the primary's mount or each other's, and a replica that can never be written (a backend
that says so: :meth:`~ckpt.storage.Storage.never_writable`). Every rank decides the same from the
same configuration, so no rank is left in a collective.
"""

from __future__ import annotations

import os
from typing import Callable

import torch.distributed as dist

from ..errors import InvalidOptionError
from ..options import SaveOptions
from .replica_options import ReplicaOptions
from .replicate import Replicator
from .steps import CheckpointRoot


def open_mounts(root: str | os.PathLike, replicas: tuple, storage_options: dict | None) -> list[CheckpointRoot]:
    mounts = [CheckpointRoot(root, storage_options), *(CheckpointRoot(url, storage_options) for url in replicas)]
    named = [(m.path.storage.scheme, m.path.storage.identity(m.path.path)) for m in mounts]
    if len(set(named)) != len(named):
        raise InvalidOptionError("replicas", list(replicas),
                                 f"must name mounts other than the root {mounts[0].path} and each other")
    for replica in mounts[1:]:
        problem = replica.path.storage.never_writable(replica.path.path)
        if problem is not None:
            raise InvalidOptionError("replicas", list(replicas),
                                     f"{problem}: replication to {replica.path} can never work")
    return mounts


def start_replicator(mounts: list[CheckpointRoot], options: SaveOptions, *, distributed: bool,
                     on_state: Callable, run: str | None) -> Replicator | None:
    """The replicator of ``mounts[1:]`` (one gloo group per replica, created collectively), or None."""
    if not options.replicas:
        return None
    groups = [dist.new_group(backend="gloo") if distributed else None for _ in options.replicas]
    return Replicator(mounts[0], mounts[1:], ReplicaOptions.of(options), groups=groups, distributed=distributed,
                      on_state=on_state, run=run)

"""A run's life across its mounts: the primary root and its replicas.

| module | concept |
|---|---|
| :mod:`~ckpt.root.steps` | :class:`CheckpointRoot`: a root's step directories, committed steps, the writer's lock, start-up clean-up, delta bases |
| :mod:`~ckpt.root.claim` | which run a mount belongs to (``.run``): every mount a manager writes claimed for one run |
| :mod:`~ckpt.root.resolve` | which checkpoint an argument means (:func:`resolve_checkpoint`, :func:`open_root`) |
| :mod:`~ckpt.root.retention` | which steps a policy deletes, applied the same way on the primary and every replica |
| :mod:`~ckpt.root.resume` | which step to load, from which mount, falling back past damage |
| :mod:`~ckpt.root.catalog.store` | the LMDB catalog: a cache of the mounts' manifests, never an authority |
| :mod:`~ckpt.root.catalog.sync` | the catalog kept true when a tool rewrote a step (:func:`record_replaced`) |
| :mod:`~ckpt.root.copy` | one step copied to another mount, verified as it streams (:func:`copy_step`) |
| :mod:`~ckpt.root.replicate` | the background :class:`Replicator` (per-mount workers, backoff, catch-up, clean-up, retention) |

Below the manager, above the commit protocol and the read side; nothing here imports the manager.
"""

from .catalog.store import Catalog, StepInfo, mount_id, open_catalog
from .catalog.sync import record_deleted, record_replaced
from .claim import foreign, read_claim
from .copy import SourceCorruptError, copy_step, holds_copy
from .replica_options import ReplicaOptions
from .replicate import Replicator
from .resolve import open_root, resolve_checkpoint
from .retention import apply as apply_retention, steps_to_delete
from .steps import LOCK_NAME, CheckpointRoot, committed_steps, step_path

__all__ = ["CheckpointRoot", "committed_steps", "step_path", "LOCK_NAME", "open_root", "resolve_checkpoint",
           "Catalog", "StepInfo", "mount_id", "open_catalog", "record_replaced", "record_deleted", "copy_step", "SourceCorruptError",
           "holds_copy", "foreign", "read_claim", "apply_retention", "steps_to_delete",
           "Replicator", "ReplicaOptions"]

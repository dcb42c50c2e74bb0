"""The catalog room: a local LMDB index of a run's steps across its mounts — a cache, never an authority.

| module | concept |
|---|---|
| :mod:`~ckpt.root.catalog.store` | :class:`Catalog` and :func:`open_catalog`: records, states, rebuilds |
| :mod:`~ckpt.root.catalog.records` | the record layout (keys, schema version, CRC-framed JSON) |
| :mod:`~ckpt.root.catalog.files` | the catalog's files on disk, checked before LMDB opens them |
| :mod:`~ckpt.root.catalog.updates` | :class:`CatalogUpdates`: the manager's commits and replication, recorded off the hot path |
| :mod:`~ckpt.root.catalog.sync` | the catalog kept true when a tool rewrote or deleted a step |
"""

from .store import ACTIVE_STATES, DIR_NAME, SCHEMA_VERSION, STATES, Catalog, MountState, StepInfo, mount_id, open_catalog
from .sync import record_deleted, record_replaced
from .updates import CatalogUpdates

__all__ = ["Catalog", "open_catalog", "MountState", "StepInfo", "mount_id", "STATES", "ACTIVE_STATES",
           "SCHEMA_VERSION", "DIR_NAME", "record_replaced", "record_deleted", "CatalogUpdates"]

"""Rank 0's updates of the run's catalog (:mod:`ckpt.root.catalog.store`), best effort: the catalog is a
cache of the mounts' manifests, so an update that fails is logged and never fails a save, a
deletion or a replication. Without a catalog (``SaveOptions.catalog=""``, or one that cannot be
opened) every update is a no-op."""

from __future__ import annotations

import logging
import os

from ...errors import CheckpointError
from ...storage import Location
from ..replica_states import ReplicaState
from .store import Catalog, open_catalog

log = logging.getLogger(__name__)


class CatalogUpdates:
    """The manager's side of the catalog: commits, deletions and replica states recorded."""

    def __init__(self, catalog: Catalog | None):
        self.catalog = catalog

    @classmethod
    def open(cls, setting: str | os.PathLike | None, primary: Location, mounts: list[Location]) -> "CatalogUpdates":
        """The catalog at ``setting`` (None: :meth:`Catalog.default_path` of ``primary``; "": none)."""
        path = setting if setting is not None else Catalog.default_path(primary)
        if not path:
            return cls(None)
        try:
            return cls(open_catalog(path, mounts))
        except CheckpointError as exc:
            log.warning("checkpoint catalog %s unavailable (%s); continuing without it", path, exc)
            return cls(None)

    def committed(self, mount: Location, step: int, manifest) -> None:
        self._call("record_commit", mount, step, manifest)

    def forget(self, mount: Location | str, step: int) -> None:
        self._call("forget", mount, step)

    def replica_state(self, mount: str, step: int, state: ReplicaState, detail: str) -> None:
        """The replicator's report (:mod:`ckpt.root.replicate`): a deleted step is forgotten."""
        if state == ReplicaState.DELETED:
            self._call("forget", mount, step)
        else:
            self._call("set_state", mount, step, state, None, detail[:500])

    def close(self) -> None:
        if self.catalog is not None:
            self.catalog.close()

    def _call(self, method: str, *args) -> None:
        if self.catalog is None:
            return
        try:
            getattr(self.catalog, method)(*args)
        except Exception as exc:  # a cache: never let it fail a save
            log.warning("checkpoint catalog update (%s) failed: %s", method, exc)

"""Keeping a root's catalog true when a tool, not the manager, rewrote one of its committed steps
(``ckpt-replay`` in place or into a root: issue 22, item 14) or deleted some (``ckpt-prune``). The catalog stays a cache: when it
cannot be updated it is left for its next :func:`~ckpt.root.catalog.store.open_catalog` to rebuild.
"""

from __future__ import annotations

import logging
import os

from ...errors import CheckpointError
from ...format import Manifest, parse_step_name
from ...storage import Location
from .store import Catalog

__all__ = ["record_replaced", "record_deleted"]

log = logging.getLogger(__name__)


def record_replaced(step_path: Location, manifest: Manifest) -> bool:
    """A tool rewrote the committed step at ``step_path`` (``ckpt-replay`` in place, or into a root):
    the catalog of that root, when it has one indexing it, records the new manifest; a damaged one is
    left to its next open to rebuild (with a warning). True when recorded."""
    step, root = parse_step_name(step_path.name), step_path.parent
    path = Catalog.default_path(root)
    if step is None or path is None or not os.path.isfile(os.path.join(path, "data.mdb")):
        return False
    try:
        with Catalog(path) as catalog:
            if catalog.mounts()[:1] != [root.display_name]:
                return False
            catalog.record_commit(root, step, manifest)
    except CheckpointError as exc:
        log.warning("catalog %s not updated for the rewritten step %s (%s); it is rebuilt when next opened",
                    path, step, exc)
        return False
    return True


def record_deleted(root: Location, steps: list[int]) -> bool:
    """A tool deleted ``steps`` of ``root`` (``ckpt-prune``): the root's catalog, when it has one
    indexing it, forgets them on that mount (the other mounts' states are left as they are)."""
    path = Catalog.default_path(root)
    if not steps or path is None or not os.path.isfile(os.path.join(path, "data.mdb")):
        return False
    try:
        with Catalog(path) as catalog:
            if catalog.mounts()[:1] != [root.display_name]:
                return False
            for step in steps:
                catalog.forget(root, step)
    except CheckpointError as exc:
        log.warning("catalog %s not updated for the deleted steps (%s); it is rebuilt when next opened", path, exc)
        return False
    return True

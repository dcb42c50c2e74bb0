"""Delta bases beside a framework's checkpoints, read from the manifests on disk (so a restarted
run knows them too): which sibling checkpoints build on a path, which base a delta names, and the
deletion of a checkpoint directory. :mod:`ckpt.integrations._store` keeps a removed checkpoint while
:func:`dependents` lists any.

A checkpoint is deleted as the manager deletes its steps (:func:`ckpt.commit.delete`): the manifest
goes first, so a crash mid-way leaves a directory without one (not a checkpoint: never listed or
loaded, removed by the next delete or save of that path), never one that looks committed and lacks
data.
"""

from __future__ import annotations

import os

from .. import CheckpointError, commit, read_manifest
from ..storage import locate


def dependents(path: str) -> list[str]:
    """Sibling checkpoints whose manifest names ``path`` as their delta base."""
    parent, name = os.path.split(path)
    found = []
    for entry in sorted(os.listdir(parent)) if os.path.isdir(parent) else ():
        sibling = os.path.join(parent, entry)
        if sibling == path or not os.path.isdir(sibling):
            continue
        try:
            if read_manifest(sibling).base == name:
                found.append(sibling)
        except CheckpointError:
            continue
    return found


def recorded_base(path: str) -> str | None:
    """The base of the delta at ``path`` as its manifest names it (None: a full one, or unreadable)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return None
    return None if manifest.base is None else os.path.join(os.path.dirname(path), manifest.base)


def delete_checkpoint(path: str) -> None:
    """Remove a checkpoint directory, manifest first (or a file or link a framework left at the path)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        commit.delete(locate(path))  # the plug-in's door: its paths are local directories

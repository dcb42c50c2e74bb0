"""Which checkpoint an argument means: the one resolver the tools and the trainer share.

    resolve_checkpoint("ckpts/run1/step-00000100")      that checkpoint (committed)
    resolve_checkpoint("ckpts/run1")                    the newest step of the root that can load
    resolve_checkpoint("ckpts/run1", step=100)          step 100 of the root
    open_root("ckpts/run1")                             the root itself (ckpt-inspect's listing)

An argument naming a committed checkpoint directory is that checkpoint (with ``step``, its manifest
must say that step). Anything else must be a checkpoint root; a name that is a step directory's or a
leftover's (``step-N``, ``step-N.tmp-<id>``) is never taken for a root, nor is a path where nothing
is. In a root, "the newest" and "step N" are what :meth:`~ckpt.root.steps.CheckpointRoot.steps`
lists: the chain-checked listing, so a delta whose chain lost a link is never chosen — the same
steps a run resumes from (:mod:`ckpt.root.resume`), so ``ckpt-merge ROOT`` and
``checkpoint.initial_load_path=ROOT`` mean the step a resumed run would take, not one that cannot
load. Every refusal is :class:`~ckpt.errors.CheckpointNotFoundError` with one line saying why.
"""

from __future__ import annotations

import os

from ..read.committed import is_committed, read_manifest, uncommitted_reason
from ..errors import CheckpointNotFoundError
from ..format import is_leftover, parse_step_name
from ..storage import Location, locate
from .steps import CheckpointRoot


def open_root(source: str | os.PathLike | Location, storage_options: dict | None = None) -> CheckpointRoot:
    """The checkpoint root ``source`` names; refused when it is named like a step directory or a
    leftover (and is not a committed checkpoint), or when nothing is there."""
    return _root_at(locate(source, storage_options))


def _root_at(location: Location) -> CheckpointRoot:
    if parse_step_name(location.name) is not None or is_leftover(location.name):
        raise CheckpointNotFoundError(uncommitted_reason(location), path=str(location))
    if not location.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint root at {location}: nothing is there (neither a checkpoint "
                                      "nor a checkpoint root)", path=str(location))
    return CheckpointRoot(location)


def resolve_checkpoint(source: str | os.PathLike | Location, step: int | None = None,
                       storage_options: dict | None = None) -> Location:
    """The checkpoint ``source`` means (see the module docstring): itself when committed, else step
    ``step`` (default: the newest that can load) of the root ``source``."""
    location = locate(source, storage_options)
    if is_committed(location):
        if step is not None:
            manifest = read_manifest(location)
            if manifest.step != step:
                raise CheckpointNotFoundError(f"{location} is step {manifest.step}, not step {step}",
                                              path=str(location))
        return location
    root = _root_at(location)
    if not root.step_dirs():
        raise CheckpointNotFoundError(f"{location} is neither a checkpoint (no manifest.json) nor a checkpoint "
                                      f"root (no step-XXXXXXXX directories)", path=str(location))
    listed = root.steps()
    if step is None and listed:
        return root.step_path(listed[-1])
    if step is not None and step in listed:
        return root.step_path(step)
    committed = root.committed()
    if step is None:
        if not committed:
            raise CheckpointNotFoundError(f"{location} holds no committed step", path=str(location))
        raise CheckpointNotFoundError(f"no step under {location} can be loaded: a link of each committed delta's "
                                      f"chain is missing or unreadable (committed: {_some(committed)})",
                                      path=str(location))
    if step in committed:
        raise CheckpointNotFoundError(f"step {step} under {location} cannot be loaded: a link of its delta chain "
                                      f"is missing or unreadable", path=str(root.step_path(step)))
    raise CheckpointNotFoundError(f"no committed step {step} under {location} (newest committed: {_some(listed)})",
                                  path=str(root.step_path(step)))


def _some(steps: list[int]) -> str:
    return ", ".join(map(str, steps[-5:])) or "none"

"""Retention: which committed steps a policy deletes, and deleting them on one mount.

Keep the newest ``keep`` committed steps, plus every step that is a multiple of ``keep_every``.
Never delete the newest committed step, nor a step that is being written (``protected``), nor any
link of the delta chain of a kept step (``bases`` maps a delta step to its base step).

:func:`steps_to_delete` is the policy (a pure function); :func:`apply` applies it to one mount — the
primary after each commit (the manager, with the steps in flight protected and their bases added)
and every replica after each copy (:mod:`ckpt.root.replicate`), the same way: the mount's listing
(:meth:`~ckpt.root.steps.CheckpointRoot.steps`: a delta whose chain lost a link is neither counted
nor deleted), its delta bases from the manifests, deletions newest first (dependents before their
bases: a crash between two deletions never leaves a listed delta whose base is gone).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from ..errors import CheckpointError
from .steps import CheckpointRoot

log = logging.getLogger(__name__)


def steps_to_delete(
    committed: list[int],
    *,
    keep: int,
    keep_every: int | None = None,
    protected: set[int] = frozenset(),
    bases: Mapping[int, int | None] | None = None,
) -> list[int]:
    if keep < 1:
        raise ValueError("keep must be at least 1 (the newest committed step is never deleted)")
    ordered = sorted(set(committed))
    kept = set(ordered[-keep:]) | set(protected)
    if keep_every:
        kept |= {s for s in ordered if s % keep_every == 0}
    pending = list(kept)
    while pending and bases:
        base = bases.get(pending.pop())
        if base is not None and base not in kept:
            kept.add(base)
            pending.append(base)
    return [s for s in ordered if s not in kept]


def apply(root: CheckpointRoot, *, keep: int, keep_every: int | None = None, protected: set[int] = frozenset(),
          bases_in_flight: Mapping[int, int | None] | None = None,
          deleted: Callable[[int], None] | None = None) -> list[int]:
    """Delete on ``root`` what the policy does not keep, newest first; ``bases_in_flight``: the bases
    of the steps being written (not yet in any manifest); ``deleted(step)`` is called after each
    deletion. Returns the deleted steps, ascending. An error stops it where it struck (raised)."""
    listed = root.steps()
    bases = {**root.bases(listed), **(bases_in_flight or {})}
    doomed = steps_to_delete(listed, keep=keep, keep_every=keep_every, protected=protected,
                             bases={s: b for s, b in bases.items() if isinstance(b, int)})
    for step in sorted(doomed, reverse=True):
        log.info("retention on %s: deleting step %d", root.path, step)
        root.delete(step)
        if deleted is not None:
            deleted(step)
    return doomed


def discard_after(root: CheckpointRoot, step: int, *, deleted: Callable[[int], None] | None = None) -> list[int]:
    """Delete every committed step of ``root`` after ``step``, newest first (a branch from ``step``:
    the later steps belong to the history it leaves). Returns them, ascending."""
    later = [s for s in root.committed() if s > step]
    for old in sorted(later, reverse=True):
        log.info("branching from step %d on %s: deleting step %d", step, root.path, old)
        root.delete(old)
        if deleted is not None:
            deleted(old)
    return later


def discard_after_on_mounts(primary: CheckpointRoot, replicas: list[CheckpointRoot], step: int, *,
                            deleted: Callable[[CheckpointRoot, int], None] | None = None) -> list[int]:
    """:func:`discard_after` on every replica, then on the primary (so a catch-up never copies the
    later steps back). A replica that fails is warned about (its later steps stay); the primary's
    failure is raised. Returns the steps deleted on the primary."""
    for mount in [*reversed(replicas), primary]:
        forget = None if deleted is None else (lambda old, m=mount: deleted(m, old))
        try:
            gone = discard_after(mount, step, deleted=forget)
        except (CheckpointError, OSError) as exc:
            if mount is primary:
                raise
            log.warning("replica %s: steps after %d not deleted (%s)", mount.path, step, exc)
    return gone

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

:func:`discard_after_on_mounts` is a branch's deletion of the later steps on every mount: finished on
every mount or raised, the primary last (see there: a failed branch is retried by branching again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from ..errors import CheckpointError
from ..read.chain import walk
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
    base_of = (bases or {}).get
    for step in list(kept):  # and every link of their chains (a walk stops at a link already kept)
        kept.update(walk(step, lambda link: None if (base := base_of(link)) in kept else base))
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
    the later steps belong to the history it leaves). Returns them, ascending. A deletion that fails
    is raised as :class:`~ckpt.errors.CheckpointError` naming the mount and the step."""
    try:
        later = [s for s in root.committed() if s > step]
    except (CheckpointError, OSError) as exc:
        raise CheckpointError(f"{root.path}: the steps after {step} cannot be listed ({_line(exc)})",
                              path=str(root.path)) from exc
    for old in sorted(later, reverse=True):
        log.info("branching from step %d on %s: deleting step %d", step, root.path, old)
        try:
            root.delete(old)
        except (CheckpointError, OSError) as exc:
            raise CheckpointError(f"{root.path}: step {old} not deleted ({_line(exc)})", path=str(root.path)) from exc
        if deleted is not None:
            deleted(old)
    return later


def discard_with_dependents(root: CheckpointRoot, step: int, *,
                            deleted: Callable[[int], None] | None = None) -> list[int]:
    """Delete ``step`` on ``root`` and every step there whose delta chain builds on it, newest first
    (a replica's stale copy, :mod:`ckpt.root.replicate`). Returns them, ascending."""
    listed = root.committed()
    bases, doomed = root.bases(listed), {step}
    for later in sorted(listed):
        if bases.get(later) in doomed:
            doomed.add(later)
    for old in sorted(doomed, reverse=True):
        log.info("%s: deleting step %d (a stale copy, or built on one)", root.path, old)
        root.delete(old)
        if deleted is not None:
            deleted(old)
    return sorted(doomed)


def discard_after_on_mounts(primary: CheckpointRoot, replicas: list[CheckpointRoot], step: int, *,
                            deleted: Callable[[CheckpointRoot, int], None] | None = None) -> list[int]:
    """A branch from ``step`` finished on every mount, or an error: :func:`discard_after` on every
    replica (each one tried, whatever the others did), then — only when every replica succeeded — on
    the primary, then once more on the replicas (a copy in flight meanwhile may have committed a
    later step there). Returns the steps deleted on the primary.

    Any failure raises :class:`~ckpt.errors.CheckpointError` naming each mount and step that failed,
    after every mount of that pass was tried. The order is what makes a failed branch safe to retry:
    the primary goes last, so while a replica still holds a later step the primary holds it too — no
    replica is ever newer than the primary's history (a resume that lost the primary never finds an
    abandoned branch as the newest step of a replica), and the same branch asked again finds the
    later steps on the primary and finishes the job."""
    _discard_on(replicas, step, deleted, "the primary keeps them too; branch again once the mount is back")
    gone = _discard_on([primary], step, deleted, "branch again")
    _discard_on(replicas, step, deleted, "branch again")
    return gone


def _discard_on(mounts: list[CheckpointRoot], step: int, deleted, then: str) -> list[int]:
    """:func:`discard_after` on each of ``mounts``; every failure raised together, after all were
    tried. Returns what the last mount deleted (the primary's, when it is the only one)."""
    failures, gone = [], []
    for mount in mounts:
        forget = None if deleted is None else (lambda old, m=mount: deleted(m, old))
        try:
            gone = discard_after(mount, step, deleted=forget)
        except CheckpointError as exc:
            log.warning("branching from step %d: %s", step, exc)
            failures.append(str(exc))
    if failures:
        raise CheckpointError(f"the branch from step {step} is not finished: {'; '.join(failures)} ({then})",
                              path=str(mounts[0].path))
    return gone


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__

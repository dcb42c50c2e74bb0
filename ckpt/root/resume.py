"""Resuming: which committed step to load, from which mount, falling back past damaged copies.

    load_step(mounts, state, step, load, run=)   that step, or CheckpointNotFoundError naming the committed ones
    load_latest(mounts, state, load, run=)       the newest step that loads in full; None only when no mount has one

Only this run's checkpoints are candidates (``run``: :mod:`ckpt.root.claim`): a replica claimed by
another run is passed over entirely, a step whose manifest names another run is left out (one
warning naming both runs each); steps that name no run (written before runs were identified) count
as this run's.

``mounts`` are the run's roots, the primary first, then its replicas (:mod:`ckpt.root.replicate`). A step
is tried on each mount that holds it, in that order; a delta's base links may come from any mount,
link by link (``mirrors``: :class:`~ckpt.read.ChunkSource`). When the primary's copy is missing or
fails verification the state comes from the next mount whose copy verifies (bitwise the same), and a
warning says which. When no mount has a good copy, the next older step is tried (newest first: on a
single mount, :meth:`~ckpt.root.steps.CheckpointRoot.steps` already leaves out deltas whose chain lost a
link, each one newer than what loads being warned about). A damaged or vanished copy
(:class:`~ckpt.errors.CorruptCheckpointError`, :class:`~ckpt.errors.CheckpointNotFoundError`) or an
unreachable mount (:class:`~ckpt.errors.StorageError`) is passed over, overwriting whatever the failed
attempt wrote; any other error — a checkpoint that does not fit the state
(:class:`~ckpt.errors.IncompatibleCheckpointError`) — stops at once: that is the user's change, not
damage. When committed steps exist but none loads, it raises: it never answers "nothing to resume"
over a state a failed load may have touched.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, ForeignRunError, StorageError
from ..storage import Location
from .claim import read_claim
from .steps import CheckpointRoot

log = logging.getLogger(__name__)

# (state, checkpoint location, other roots for the chain's links) -> anything; raises CheckpointError
LoadFn = Callable[[dict, Location, tuple], Any]
# What passes over a copy: damage, absence, or an unreachable mount (a raw OSError from a backend
# that does not map its errors to StorageError is treated alike).
DAMAGE = (CorruptCheckpointError, CheckpointNotFoundError, StorageError, OSError)


def _committed(mount: CheckpointRoot, *, chain_checked: bool, run: str | None = None) -> list[int]:
    """The mount's committed steps that may be loaded as this run's (``run``): a step another run
    wrote is left out, one warning naming both runs."""
    try:
        steps = mount.steps() if chain_checked else mount.committed()
    except (StorageError, OSError) as exc:
        log.warning("checkpoint mount %s cannot be listed (%s); passing over it", mount.path, exc)
        return []
    if run is None:
        return steps
    runs = mount.runs(steps)
    others = {step: runs[step] for step in steps if runs[step] not in (None, run)}
    if others:
        names = ", ".join(sorted(set(others.values())))
        shown = ", ".join(map(str, sorted(others)[-20:]))
        log.warning("checkpoint mount %s holds steps of another run (run %s; this is run %s): not loading "
                    "steps %s", mount.path, names, run, shown)
    return [step for step in steps if step not in others]


def ours(mounts: list[CheckpointRoot], run: str | None) -> list[CheckpointRoot]:
    """The primary and each replica not claimed by another run (``.run``; one warning naming both
    runs for each one that is): only these are loaded from, for a step or a delta's link."""
    if run is None:
        return list(mounts)
    kept = [mounts[0]]
    for mount in mounts[1:]:
        try:
            record = read_claim(mount.path)
        except ForeignRunError as exc:
            log.warning("checkpoint mount %s passed over: %s", mount.path, exc)
            continue
        except (CheckpointError, OSError):
            record = None  # unreachable now: listing it passes over it
        if record is not None and record["run"] != run:
            log.warning("checkpoint mount %s belongs to another run (claimed by run %s; this is run %s); "
                        "not loading from it", mount.path, record["run"], run)
            continue
        kept.append(mount)
    return kept


def _load_from(mounts: list[CheckpointRoot], holders: list[CheckpointRoot], state: dict, step: int,
               load: LoadFn) -> CheckpointError | None:
    """Load ``step`` from the first of ``holders`` whose copy loads; the last failure, or None."""
    failure = None
    for mount in holders:
        mirrors = tuple(m.path for m in mounts)  # every link is looked for on its own mount first
        try:
            load(state, mount.step_path(step), mirrors)
        except DAMAGE as exc:
            if len(holders) > 1:
                log.warning("checkpoint step %d on %s cannot be loaded (%s)", step, mount.path, exc)
            failure = exc
            continue
        if mount is not mounts[0]:
            log.warning("checkpoint step %d loaded from replica %s (the primary %s has no good copy)",
                        step, mount.path, mounts[0].path)
            warnings.warn(f"checkpoint step {step} loaded from replica {mount.path}", stacklevel=4)
        return None
    return failure


def load_step(mounts: list[CheckpointRoot], state: dict, step: int, load: LoadFn, *, run: str | None = None) -> int:
    mounts = ours(mounts, run)
    holders = [m for m in mounts if step in _committed(m, chain_checked=False, run=run)]
    if not holders:
        shown = ", ".join(map(str, mounts[0].steps()[-20:])) or "none"
        raise CheckpointNotFoundError(
            f"no committed checkpoint of step {step} under {mounts[0].path}; committed steps: {shown}",
            path=str(mounts[0].step_path(step)))
    failure = _load_from(mounts, holders, state, step, load)
    if failure is not None:
        raise failure
    return step


def load_latest(mounts: list[CheckpointRoot], state: dict, load: LoadFn, *, run: str | None = None) -> int | None:
    mounts = ours(mounts, run)
    single = len(mounts) == 1
    holders: dict[int, list[CheckpointRoot]] = {}
    for mount in mounts:
        for step in _committed(mount, chain_checked=single, run=run):
            holders.setdefault(step, []).append(mount)
    listed = sorted(holders)
    orphans = sorted(set(mounts[0].committed()) - set(listed), reverse=True) if single else []
    for orphan in orphans:
        if not listed or orphan > listed[-1]:
            _fall_back(orphan, "a link of its delta chain is missing or unreadable")
    failed: list[tuple[int, CheckpointError]] = []
    for candidate in reversed(listed):
        failure = _load_from(mounts, holders[candidate], state, candidate, load)
        if failure is None:
            return candidate
        failed.append((candidate, failure))
        _fall_back(candidate, failure)
    if failed or orphans:
        newest = failed[0] if failed else (orphans[0], "a link of its delta chain is missing")
        where = ", ".join(str(m.path) for m in mounts)
        raise CorruptCheckpointError(
            f"no checkpoint under {where} can be loaded ({len(failed) + len(orphans)} committed; newest, "
            f"step {newest[0]}: {newest[1]}); the state may be partly overwritten", path=str(mounts[0].path))
    return None


def _fall_back(step: int, why: object) -> None:
    log.warning("checkpoint step %d cannot be loaded (%s); trying an older one", step, why)
    warnings.warn(f"checkpoint step {step} cannot be loaded ({why}); falling back", stacklevel=4)

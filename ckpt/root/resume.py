"""Resuming: which committed step to load, from which mount, falling back past damaged copies.

    load_step(mounts, state, step, load, run=)   that step, or CheckpointNotFoundError naming the committed ones
    load_latest(mounts, state, load, run=)       the newest step that loads in full; None only when no mount has one

Every rank decides together (``agree``: :class:`ckpt.collective.Agreement` over the manager's
control group): rank 0 lists the candidates and the mounts holding each for every rank, and each
load attempt fails on every rank or on none (the first failing rank's error), so no rank resumes
from a step another refused. A step that fails as damaged on every mount holding it, as every rank
saw it, is set aside on each of them by rank 0 (:mod:`ckpt.root.damaged`: renamed
``step-N.damaged-<time>``, never deleted) before the next older step is tried: it is no longer
history the run could return to, and training through it again writes a fresh one. An explicit
``load_step`` is never set aside: it fails.

Only this run's checkpoints are candidates (``run``: :mod:`ckpt.root.claim`): a replica claimed by
another run is passed over entirely, a step whose manifest names another run is left out (one
warning naming both runs each); steps that name no run (written before runs were identified) count
as this run's.

``mounts`` are the run's roots, the primary first, then its replicas (:mod:`ckpt.root.replicate`).
Rank 0 lists the replicas on threads while it lists the primary (:mod:`ckpt.root.answer`); when the
primary has steps, a replica that has not answered 5 s after it is passed over, with a line, and
asked again — however long it takes — only if a copy on the mounts that answered fails. A step
is tried on each mount that holds it, in that order; a delta's base links may come from any mount,
link by link (``mirrors``: :class:`~ckpt.read.source.ChunkSource`). When the primary's copy is missing or
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

from ..collective import LOCAL, Agreement
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, ForeignRunError, StorageError
from ..storage import Location
from .answer import REPLICA_WAIT_S, primary_then_replicas
from .claim import read_claim
from .damaged import damaged_steps, set_aside, utc_stamp
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


def _ours(mount: CheckpointRoot, run: str | None) -> bool:
    """Whether a replica is this run's (or claimed by none): one claimed by another run is passed
    over entirely, one warning naming both runs."""
    if run is None:
        return True
    try:
        record = read_claim(mount.path)
    except ForeignRunError as exc:
        log.warning("checkpoint mount %s passed over: %s", mount.path, exc)
        return False
    except (CheckpointError, OSError):
        return True  # unreachable now: listing it passes over it
    if record is not None and record["run"] != run:
        log.warning("checkpoint mount %s belongs to another run (claimed by run %s; this is run %s); "
                    "not loading from it", mount.path, record["run"], run)
        return False
    return True


def _listings(mounts: list[CheckpointRoot], run: str | None, *, chain_checked_alone: bool,
              patient: bool = False) -> tuple[dict[int, list[int]], bool]:
    """Rank 0: mount index -> its committed steps, for the primary and each replica that is this
    run's (:func:`_ours`) and answered in time (:mod:`ckpt.root.answer`: every replica is asked at
    once, on threads, while the primary is listed; when the primary has steps, one that has not
    answered ``REPLICA_WAIT_S`` seconds later is passed over, saying so, unless ``patient``); and
    whether one was passed over so. ``chain_checked_alone``: when the primary is the only mount
    left, its steps whose delta chains are whole."""
    if len(mounts) == 1:
        return {0: _committed(mounts[0], chain_checked=chain_checked_alone, run=run)}, False
    primary, replicas = primary_then_replicas(
        lambda: _committed(mounts[0], chain_checked=False, run=run),
        [lambda mount=mount: _committed(mount, chain_checked=False, run=run) if _ours(mount, run) else None
         for mount in mounts[1:]],
        wait_all=lambda steps: patient or not steps)
    found, hurried = {0: primary}, False
    for index, (done, steps, error) in enumerate(replicas, 1):
        if error is not None:
            raise error
        if not done:
            hurried = True
            log.warning("checkpoint mount %s has not answered %.0f s after the primary (newest step %d); passing "
                        "over it unless the primary's copies fail", mounts[index].path, REPLICA_WAIT_S, max(primary))
        elif steps is not None:
            found[index] = steps
    if len(found) == 1 and chain_checked_alone:
        found[0] = _committed(mounts[0], chain_checked=True, run=run)
    return found, hurried


def _ask_the_rest(step: int, failure: BaseException) -> None:
    log.warning("checkpoint step %d cannot be loaded from the mounts that answered (%s); asking the replicas "
                "passed over, however long they take", step, failure)


def _load_from(mounts: list[CheckpointRoot], holders: list[CheckpointRoot], state: dict, step: int,
               load: LoadFn) -> tuple[CheckpointError | None, bool]:
    """Load ``step`` from the first of ``holders`` whose copy loads: (None, _), or the last failure
    and whether every copy failed as damaged (:class:`~ckpt.errors.CorruptCheckpointError`)."""
    failure, damaged = None, True
    for mount in holders:
        mirrors = tuple(m.path for m in mounts)  # every link is looked for on its own mount first
        try:
            load(state, mount.step_path(step), mirrors)
        except DAMAGE as exc:
            if len(holders) > 1:
                log.warning("checkpoint step %d on %s cannot be loaded (%s)", step, mount.path, exc)
            failure, damaged = exc, damaged and isinstance(exc, CorruptCheckpointError)
            continue
        if mount is not mounts[0]:
            log.warning("checkpoint step %d loaded from replica %s (the primary %s has no good copy)",
                        step, mount.path, mounts[0].path)
            warnings.warn(f"checkpoint step {step} loaded from replica {mount.path}", stacklevel=4)
        return None, False
    return failure, damaged


def agreed(load: LoadFn, agree: Agreement) -> LoadFn:
    """``load`` made one decision of every rank: each attempt fails on every rank, with the first
    failing rank's error, or on none — so every rank walks the same candidates and mounts."""
    return lambda state, path, mirrors: agree.each(lambda: load(state, path, mirrors))


def _holders(mounts: list[CheckpointRoot], step: int, run: str | None,
             patient: bool) -> tuple[list[int], list[int], bool]:
    found, hurried = _listings(mounts, run, chain_checked_alone=False, patient=patient)
    return sorted(found), [index for index in sorted(found) if step in found[index]], hurried


def load_step(mounts: list[CheckpointRoot], state: dict, step: int, load: LoadFn, *, run: str | None = None,
              agree: Agreement = LOCAL) -> int:
    for patient in (False, True):  # patient: once the mounts that answered in time have no good copy
        kept, holding, hurried = agree.decided(lambda: _holders(mounts, step, run, patient))  # rank 0 lists
        failure = None
        if holding:
            failure, _ = _load_from([mounts[i] for i in kept], [mounts[i] for i in holding], state, step,
                                    agreed(load, agree))
            if failure is None:
                return step
        if not hurried:
            break
        _ask_the_rest(step, failure or "none holds it")
    if failure is not None:
        raise failure
    shown = agree.decided(lambda: _not_there(mounts[0], step))
    raise CheckpointNotFoundError(
        f"no committed checkpoint of step {step} under {mounts[0].path}; committed steps: {shown}",
        path=str(mounts[0].step_path(step)))


def _not_there(primary: CheckpointRoot, step: int) -> str:
    """The committed steps, and where ``step`` went if a resume set it aside as damaged."""
    shown = ", ".join(map(str, primary.steps()[-20:])) or "none"
    aside = [name for number, name in damaged_steps(primary.path) if number == step]
    return shown + (f" (step {step} was set aside as damaged: {aside[-1]})" if aside else "")


def _candidates(mounts: list[CheckpointRoot], run: str | None,
                patient: bool) -> tuple[list[int], list[tuple[int, list[int]]], list[int], bool]:
    """Rank 0's listing: the mounts kept (indices), each committed step with the mounts holding it
    (newest first), on a single mount the committed deltas whose chain lost a link, and whether a
    replica was passed over for not answering in time (see :func:`_listings`)."""
    found, hurried = _listings(mounts, run, chain_checked_alone=True, patient=patient)
    kept = sorted(found)
    holders: dict[int, list[int]] = {}
    for index in kept:
        for step in found[index]:
            holders.setdefault(step, []).append(index)
    listed = sorted(holders)
    orphans = sorted(set(mounts[0].committed()) - set(listed), reverse=True) if len(kept) == 1 else []
    return kept, [(step, holders[step]) for step in reversed(listed)], orphans, hurried


def load_latest(mounts: list[CheckpointRoot], state: dict, load: LoadFn, *, run: str | None = None,
                agree: Agreement = LOCAL, on_set_aside: Callable | None = None) -> int | None:
    load, patient = agreed(load, agree), False
    while True:  # twice at most: again, patient, when a copy fails while a replica was passed over
        kept, candidates, orphans, hurried = agree.decided(lambda: _candidates(mounts, run, patient))
        newest_listed = candidates[0][0] if candidates else None
        for orphan in orphans:
            if newest_listed is None or orphan > newest_listed:
                _fall_back(orphan, "a link of its delta chain is missing or unreadable")
        failed: list[tuple[int, CheckpointError]] = []
        for candidate, holding in candidates:
            holders = [mounts[i] for i in holding]
            failure, damaged = _load_from([mounts[i] for i in kept], holders, state, candidate, load)
            if failure is None:
                return candidate
            if hurried:  # the replica passed over may hold a good copy: every mount's listing first
                _ask_the_rest(candidate, failure)
                break
            failed.append((candidate, failure))
            _fall_back(candidate, failure)
            if not agree.any(not damaged):  # damaged on every mount, as every rank saw it
                agree.decided(lambda: _set_aside(holders, candidate, on_set_aside))
        else:
            break
        patient = True
    if failed or orphans:
        newest = failed[0] if failed else (orphans[0], "a link of its delta chain is missing")
        where = ", ".join(str(mounts[i].path) for i in kept)
        raise CorruptCheckpointError(
            f"no checkpoint under {where} can be loaded ({len(failed) + len(orphans)} committed; newest, "
            f"step {newest[0]}: {newest[1]}); the state may be partly overwritten", path=str(mounts[0].path))
    return None


def _set_aside(holders: list[CheckpointRoot], step: int, on_set_aside: Callable | None) -> None:
    """Rank 0: ``step`` (damaged on every mount holding it) moved out of the step namespace on each
    (:mod:`ckpt.root.damaged`); a mount where that fails is warned about and keeps it."""
    when = utc_stamp()
    for mount in holders:
        try:
            mount.check_held()  # a writer that lost the root moves nothing there
            where = set_aside(mount.path, step, when)
        except (CheckpointError, OSError) as exc:
            log.warning("checkpoint step %d on %s is damaged but could not be set aside (%s)", step, mount.path, exc)
            continue
        mount.forget(step)
        if where is not None:
            log.warning("checkpoint step %d on %s cannot be loaded: set aside as %s", step, mount.path, where)
            if on_set_aside is not None:
                on_set_aside(mount, step, where)


def _fall_back(step: int, why: object) -> None:
    log.warning("checkpoint step %d cannot be loaded (%s); trying an older one", step, why)
    warnings.warn(f"checkpoint step {step} cannot be loaded ({why}); falling back", stacklevel=4)

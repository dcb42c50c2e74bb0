"""Resuming: which committed step of a root to load, and falling back past damaged ones.

    load_step(root, state, step)   that step, or CheckpointNotFoundError naming the committed ones
    load_latest(root, state)       the newest step that loads in full; None only for an empty root

``load_latest`` tries the listed steps newest first (:meth:`~ckpt.root.CheckpointRoot.steps`
already leaves out deltas whose chain lost a link; each one newer than what loads is warned about).
A damaged or vanished step (:class:`~ckpt.errors.CorruptCheckpointError`,
:class:`~ckpt.errors.CheckpointNotFoundError`) is reported with a warning and the next older one is
loaded in full, overwriting whatever the failed attempt wrote. Any other error — a checkpoint that
does not fit the state (:class:`~ckpt.errors.IncompatibleCheckpointError`) — stops at once: that is
the user's change, not damage. When committed steps exist but none loads, it raises: it never
answers "nothing to resume" over a state a failed load may have touched.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .root import CheckpointRoot

log = logging.getLogger(__name__)

LoadFn = Callable[[dict, Any], Any]  # (state, checkpoint path) -> anything; raises CheckpointError


def load_step(root: CheckpointRoot, state: dict, step: int, load: LoadFn) -> int:
    if not root.is_committed(step):
        shown = ", ".join(map(str, root.steps()[-20:])) or "none"
        raise CheckpointNotFoundError(
            f"no committed checkpoint of step {step} under {root.path}; committed steps: {shown}",
            path=str(root.step_path(step)))
    load(state, root.step_path(step))
    return step


def load_latest(root: CheckpointRoot, state: dict, load: LoadFn) -> int | None:
    listed = root.steps()
    orphans = sorted(set(root.committed()) - set(listed), reverse=True)
    for orphan in orphans:
        if not listed or orphan > listed[-1]:
            _fall_back(orphan, "a link of its delta chain is missing or unreadable")
    failed: list[tuple[int, CheckpointError]] = []
    for candidate in reversed(listed):
        try:
            load(state, root.step_path(candidate))
            return candidate
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            failed.append((candidate, exc))
            _fall_back(candidate, exc)
    if failed or orphans:
        newest = failed[0] if failed else (orphans[0], "a link of its delta chain is missing")
        raise CorruptCheckpointError(
            f"no checkpoint under {root.path} can be loaded ({len(failed) + len(orphans)} committed; newest, "
            f"step {newest[0]}: {newest[1]}); the state may be partly overwritten", path=str(root.path))
    return None


def _fall_back(step: int, why: object) -> None:
    log.warning("checkpoint step %d cannot be loaded (%s); trying an older one", step, why)
    warnings.warn(f"checkpoint step {step} cannot be loaded ({why}); falling back", stacklevel=4)

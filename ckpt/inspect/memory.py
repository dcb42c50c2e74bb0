"""The memory tier's steps of a run as ``ckpt-inspect ROOT`` lists them after its storage steps
(issue 38): the complete steps this machine holds in ``<memory>/<run>`` (:mod:`ckpt.memory.store`),
read only.

* which run: ROOT's ``.run`` record (:func:`ckpt.inspect.report.primary_run`); no record, nothing
  listed (another run's directory beside it is never read);
* which directory: the one the caller names (``--memory DIR``), else the trainer's
  ``checkpoint.memory`` as the newest step's run config records it (``user.config``,
  :func:`recorded_directory`), when that directory exists on this machine;
* each step (:func:`memory_rows`): its node (its ``COMPLETE``'s), its ranks split into the node's
  own and the copies of its partner node's ranks (by the ranks per node ``COMPLETE`` records; both
  None for a record without it), and the bytes of those ranks' files.

Nothing is created or changed (``memory_steps`` opens with ``create=False``). A directory that is
missing lists nothing; one that is unsafe (a link, another user's, open to others) or unreadable is
one note through the caller's ``note``, never an error.
"""

from __future__ import annotations

import os
from typing import Callable

from ..errors import CheckpointError
from ..read.committed import read_manifest
from ..storage import Location
from .report import primary_run
from .step import run_config

Note = Callable[[str], None]


def recorded_directory(newest: Location | None) -> str | None:
    """The ``checkpoint.memory`` the run config of the checkpoint ``newest`` records, when it names a
    directory of this machine; else (no such step, no config, not recorded, not here) None."""
    if newest is None:
        return None
    try:
        manifest = read_manifest(newest)
    except CheckpointError:
        return None
    config = (run_config(manifest) or {}).get("config") or {}
    section = config.get("checkpoint")
    directory = section.get("memory") if isinstance(section, dict) else None
    return directory if isinstance(directory, str) and directory and os.path.isdir(directory) else None


def memory_rows(directory: str | os.PathLike, run: str) -> list[dict]:
    """Run ``run``'s complete memory steps in ``directory``, oldest first: ``{"step", "node", "ranks",
    "own", "partner", "partner_node", "bytes"}`` (``own``/``partner``: rank lists, None when the
    step's record does not say how many ranks a node has; ``partner_node``: the node the copies are
    of, None when there are none)."""
    # imported here: the memory room's face brings its tier and torch.distributed.checkpoint (~1.3 s of
    # CPU at start-up), which ckpt-inspect needs only for a run with a memory directory
    from ..memory.nodes import node_of
    from ..memory.store import memory_steps

    rows = []
    for step in memory_steps(directory, run):
        per_node, node, ranks = step["local_world"], step["node"], step["ranks"]
        own = partner = partner_node = None
        if per_node is not None:
            own = [rank for rank in ranks if node_of(rank, per_node) == node]
            partner = [rank for rank in ranks if node_of(rank, per_node) != node]
            nodes = {node_of(rank, per_node) for rank in partner}
            partner_node = nodes.pop() if len(nodes) == 1 else None
        rows.append({"step": step["step"], "node": node, "ranks": ranks, "own": own, "partner": partner,
                     "partner_node": partner_node, "bytes": step["bytes"]})
    return rows


def memory_listing(root: Location, newest: Location | None, directory: str | None, *, note: Note
                   ) -> tuple[str | None, str | None, list[dict]]:
    """``(directory, run, rows)`` for the run at ``root``: ``directory`` (the caller's) or the one
    ``newest`` records (:func:`recorded_directory`); ``(None, None, [])`` when there is neither."""
    directory = directory or recorded_directory(newest)
    if directory is None:
        return None, None, []
    run = primary_run(root)
    if run is None:
        note(f"{root} has no run record (.run): its memory steps in {directory} cannot be told apart; not listed")
        return directory, None, []
    try:
        return directory, run, memory_rows(directory, run)
    except (CheckpointError, OSError) as exc:
        note(f"memory steps in {directory} not listed: {' '.join(str(exc).split())}")
        return directory, run, []

"""A checkpoint root: the directory holding one run's checkpoints, one per step.

    <root>/step-00000100/              committed (it holds manifest.json; see ckpt.commit)
    <root>/step-00000100.tmp-<id>/     a save in progress, or a dead one: invisible to readers
    <root>/step-00000100.old-<id>/     a committed copy moved aside by an overwriting save
    <root>/.lock                       the one writer's lock (flock on POSIX, a lease on object
                                       stores); it names the holder's host and pid

The root is a directory or a URL (``s3://bucket/run``); every access goes through its mount
(:mod:`ckpt.storage`).

:class:`CheckpointRoot` owns the step directories (named and parsed by :mod:`ckpt.format.names`), the
list of committed steps (the manifests are the truth), the writer's lock, the start-up clean-up after
dead saves and the delta bases of committed steps (step -> base step, read once from their
manifests) that retention needs. The manager,
retention and the tools share it.

Listing never offers a delta whose chain lost a link (:meth:`CheckpointRoot.steps`); retention
deletes newest first, so no listed step ever depends on one already gone (the manager does that).
"""

from __future__ import annotations

import logging
import os

from . import commit
from .committed import read_manifest
from .errors import CheckpointError, StorageError
from .format import parse_step_name, step_name
from .storage import Location, holder_text, locate

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
UNREADABLE = "unreadable"  # in the base map: the step's manifest could not be read


def step_path(root: str | os.PathLike | Location, step: int, storage_options: dict | None = None) -> Location:
    return locate(root, storage_options) / step_name(step)


def committed_steps(root: str | os.PathLike | Location, storage_options: dict | None = None) -> list[int]:
    """Steps with a committed checkpoint under ``root``, ascending."""
    return CheckpointRoot(root, storage_options).steps()


class CheckpointRoot:
    """The checkpoints of one run under ``path``, a directory or URL (see the module docstring)."""

    def __init__(self, path: str | os.PathLike | Location, storage_options: dict | None = None):
        self.path = locate(path, storage_options)
        self._bases: dict[int, int | None] = {}
        self._lock = None
        self._directory_id = None  # set by lock()

    def step_path(self, step: int) -> Location:
        return self.path / step_name(step)

    def step_dirs(self) -> dict[int, Location]:
        """Every ``step-N`` entry under the root, committed or not."""
        found = {}
        for name in self.path.list():
            step = parse_step_name(name)
            if step is not None:
                found[step] = self.path / name
        return found

    def committed(self) -> list[int]:
        """Steps whose directory holds a manifest, ascending (loadable or not)."""
        return sorted(step for step, path in self.step_dirs().items() if commit.is_committed(path))

    def steps(self) -> list[int]:
        """Committed steps that can be loaded as far as the listing can tell, ascending: a delta
        is listed only when its base is, down to a full checkpoint (a delta whose chain lost a
        link is never offered). A step whose manifest cannot be read is listed; loading it
        reports why."""
        committed = self.committed()
        bases = self.bases(committed)
        return [step for step in committed if bases[step] is UNREADABLE or self._chain_resolves(step, bases)]

    @staticmethod
    def _chain_resolves(step: int, bases: dict) -> bool:
        """Whether every link from ``step`` down to a full checkpoint is committed and readable."""
        seen = set()
        while step in bases and step not in seen and bases[step] is not UNREADABLE:
            if bases[step] is None:
                return True
            seen.add(step)
            step = bases[step]
        return False

    def is_committed(self, step: int) -> bool:
        return commit.is_committed(self.step_path(step))

    # -- the writer's side -------------------------------------------------------------------
    def lock(self) -> None:
        """Become the root's one writer: create it, take ``.lock`` (refused with the holder's host
        and pid while another writer has it) and delete what dead saves left (tmp dirs, moved-aside
        copies, step dirs without a manifest: an interrupted deletion or, on object stores, a save
        that never committed; objects no manifest references)."""
        storage = self.path.storage
        storage.makedirs(self.path.path)
        self._lock = storage.lock((self.path / LOCK_NAME).path, holder=holder_text())
        self._directory_id = storage.directory_id(self.path.path)
        try:
            commit.collect_root_garbage(self.path)
            for path in self.step_dirs().values():
                if not storage.atomic_rename:
                    commit.collect_garbage(path)
                elif path.is_dir() and not commit.is_committed(path):
                    log.info("removing %s: no manifest (an interrupted deletion)", path)
                    commit.delete(path)
        except BaseException:
            self.unlock()
            raise

    def check_unchanged(self) -> None:
        """Refuse to write when the root is no longer the directory that was locked (its file system
        was unmounted, or it was deleted): a save would otherwise re-create it underneath, report
        success, and vanish when the file system comes back."""
        locked = self._directory_id
        if locked is not None and self.path.storage.directory_id(self.path.path) != locked:
            raise StorageError(f"{self.path} is no longer the directory this manager locked (its file system "
                               "was unmounted, or it was deleted); not writing there", path=str(self.path))

    def unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def bases(self, steps: list[int]) -> dict[int, int | None]:
        """Base step of each of ``steps``: None for a full one, :data:`UNREADABLE` when its manifest
        cannot be read; read from the manifest, once (the steps being written are the manager's
        :class:`~ckpt.delta.DeltaChain`'s to tell)."""
        for step in steps:
            if step not in self._bases:
                try:
                    self._bases[step] = read_manifest(self.step_path(step)).base_step
                except CheckpointError:
                    self._bases[step] = UNREADABLE
        return {step: self._bases[step] for step in steps}

    def delete(self, step: int) -> None:
        commit.delete(self.step_path(step))
        self._bases.pop(step, None)

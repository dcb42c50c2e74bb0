"""A checkpoint root: the directory holding one run's checkpoints, one per step.

    <root>/step-00000100/              committed (it holds manifest.json; see ckpt.commit)
    <root>/step-00000100.tmp-<id>/     a save in progress, or a dead one: invisible to readers
    <root>/step-00000100.old-<id>/     a committed copy moved aside by an overwriting save
    <root>/.lock                       the one writer's lock (flock on POSIX, a lease on object
                                       stores: ckpt.storage.lease); it names the holder's host and pid
    <root>/.run                        which run the root belongs to (ckpt.root.claim)

The root is a directory or a URL (``s3://bucket/run``); every access goes through its mount
(:mod:`ckpt.storage`).

:class:`CheckpointRoot` owns the step directories (named and parsed by :mod:`ckpt.format.names`), the
list of committed steps (the manifests are the truth), the writer's lock, the start-up clean-up after
dead saves and interrupted deletions (:meth:`CheckpointRoot.clean_up`: run by :meth:`lock` on the
primary and by the replica worker on each replica, :mod:`ckpt.root.replicate`, each after the mount
was claimed for the run: :mod:`ckpt.root.claim`), the fence of a lease (:meth:`CheckpointRoot.check_held`:
before each commit and deletion) and the delta bases and run identities of committed steps (step ->
base step, run; read once from their manifests) that retention and resuming need — and the newest
of those manifests as read (:meth:`CheckpointRoot.manifest`), so that a resume parses and validates
the step it loads once, not once to list it and again to load it. One object
per mount and run: the manager, its retention and its replicator share it (its base map is
thread-safe); the tools build their own.

Listing never offers a delta whose chain lost a link (:meth:`CheckpointRoot.steps`); retention
deletes newest first, so no listed step ever depends on one already gone (:mod:`ckpt.root.retention`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from .. import commit
from ..read.chain import ChainLoopError, listed_base, walk
from ..read.committed import is_committed, read_manifest
from ..errors import CheckpointError, StorageError
from ..format import Manifest, parse_step_name, step_name
from ..storage import Location, holder_text, locate

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
UNREADABLE = "unreadable"  # in the base map: the step's manifest could not be read


def step_path(root: str | os.PathLike | Location, step: int, storage_options: dict | None = None) -> Location:
    return locate(root, storage_options) / step_name(step)


def committed_steps(root: str | os.PathLike | Location, storage_options: dict | None = None) -> list[int]:
    """Steps with a committed checkpoint under ``root`` that can be loaded as far as the listing
    can tell (:meth:`CheckpointRoot.steps`), ascending."""
    return CheckpointRoot(root, storage_options).steps()


class CheckpointRoot:
    """The checkpoints of one run under ``path``, a directory or URL (see the module docstring)."""

    def __init__(self, path: str | os.PathLike | Location, storage_options: dict | None = None):
        self.path = locate(path, storage_options)  # the door: once (a Location passes through)
        self._headers: dict[int, tuple] = {}  # step -> (base step | None | UNREADABLE, run | None)
        self._newest: tuple[int, object, Manifest] | None = None  # (step, its directory_id, manifest)
        self._bases_lock = threading.Lock()  # the writer thread and replica workers share the map
        self._lock = None
        self._directory_id = None  # set by lock()
        self.run: str | None = None  # the run this root is claimed for (set by lock's claim)

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
        return sorted(step for step, path in self.step_dirs().items() if is_committed(path))

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
        try:
            *_, last = walk(step, listed_base(bases))
        except ChainLoopError:
            return False
        return last in bases and bases[last] is None  # ended at a full checkpoint, not at a lost link

    def is_committed(self, step: int) -> bool:
        return is_committed(self.step_path(step))

    # -- the writer's side -------------------------------------------------------------------
    def lock(self, claim: Callable[["CheckpointRoot"], str] | None = None) -> None:
        """Become the root's one writer: create it, take ``.lock`` (refused with the holder's host
        and pid while another writer has it), claim it for a run (``claim(root)`` returns the run's
        identity, or raises: :mod:`ckpt.root.claim`) and :meth:`clean_up`."""
        storage = self.path.storage
        commit.make_directory(self.path)  # durable: a crash must not take the root with its steps
        self._lock = storage.lock((self.path / LOCK_NAME).path, holder=holder_text())
        try:
            self._directory_id = storage.directory_id(self.path.path)
            if claim is not None:
                self.run = claim(self)
            self.clean_up()
        except BaseException:
            self.unlock()
            raise

    def check_held(self) -> None:
        """The fence: raise :class:`~ckpt.errors.CheckpointLockedError` when this writer lost the
        root's lock (a lease taken over while it was paused; ``flock`` cannot be lost)."""
        check = getattr(self._lock, "check", None)
        if check is not None:
            check()

    def clean_up(self) -> None:
        """Delete what dead saves and interrupted deletions left under the root: tmp dirs,
        moved-aside copies (a committed one is moved back), step dirs without a manifest (an
        interrupted deletion or, on object stores, a save that never committed) and objects no
        manifest references. Only the root's writer may call it."""
        commit.collect_root_garbage(self.path)
        for step, path in self.step_dirs().items():
            commit.collect_uncommitted(path)
            if not is_committed(path):
                self.forget(step)

    def check_writable(self) -> None:
        """Before a save begins: the root is still the directory locked, and still this writer's."""
        self.check_unchanged()
        self.check_held()

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
        :class:`~ckpt.write.delta.DeltaChain`'s to tell)."""
        return {step: header[0] for step, header in self._read_headers(steps).items()}

    def runs(self, steps: list[int]) -> dict[int, str | None]:
        """The run that wrote each of ``steps`` (its manifest's ``run``): None when it names none
        (written before runs were identified, or by ``ckpt.save``) or cannot be read."""
        return {step: header[1] for step, header in self._read_headers(steps).items()}

    def manifest(self, step: int) -> Manifest:
        """The manifest of committed ``step``: the newest one read for the listing when it is
        ``step``'s and its directory is still the one read (a committed step does not change in
        place; deleting or rewriting it here forgets it: :meth:`forget`), else read now. Raises as
        :func:`~ckpt.read.committed.read_manifest`."""
        with self._bases_lock:
            newest = self._newest
        path = self.step_path(step)
        if newest is not None and newest[0] == step and newest[1] == path.storage.directory_id(path.path):
            return newest[2]
        return read_manifest(path)

    def manifest_at(self, path: Location) -> Manifest:
        """:meth:`manifest` for ``path`` when it is one of this root's step directories, else the
        manifest read from ``path``."""
        step = parse_step_name(path.name)
        if step is not None and str(self.step_path(step)) == str(path):
            return self.manifest(step)
        return read_manifest(path)

    def _read_headers(self, steps: list[int]) -> dict[int, tuple]:
        with self._bases_lock:
            known = {step: self._headers[step] for step in steps if step in self._headers}
        found, newest = {}, None
        for step in steps:  # read outside the lock: manifests may be on a slow mount
            if step not in known and step not in found:
                try:
                    path = self.step_path(step)
                    where = path.storage.directory_id(path.path)
                    manifest = read_manifest(path)
                    found[step] = (manifest.base_step, manifest.run)
                    if newest is None or step > newest[0]:
                        newest = (step, where, manifest)
                except CheckpointError:
                    found[step] = (UNREADABLE, None)
        with self._bases_lock:
            for step, header in found.items():
                self._headers.setdefault(step, header)
            if newest is not None and (self._newest is None or newest[0] > self._newest[0]):
                self._newest = newest
        known.update(found)
        return {step: known[step] for step in steps}

    def delete(self, step: int) -> None:
        self.check_held()  # a writer that lost the root deletes nothing there
        commit.delete(self.step_path(step))
        self.forget(step)

    def forget(self, step: int) -> None:
        """Drop what was read of ``step`` (its header, its manifest): it was deleted or rewritten."""
        with self._bases_lock:
            self._headers.pop(step, None)
            if self._newest is not None and self._newest[0] == step:
                self._newest = None

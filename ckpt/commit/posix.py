"""The commit strategy of POSIX mounts (local disk, NFS, Lustre): write under a temporary name
beside the target, make it durable, rename it into place (the model: orbax's
``AtomicRenameTemporaryPath``).

A checkpoint's attempt is the directory ``<name>.tmp-<id>/``; its data files are fsync'd by the ranks
that wrote them, then ``data/`` and the directory are fsync'd, the manifest written and fsync'd there,
and the directory renamed to ``<name>``, the parent fsync'd: the rename is the commit point. A target
already there (replaced only when asked) is moved aside to ``<name>.old-<id>`` first, deleted once the
new one is in place; after a crash between the two renames the next writer moves the old copy back.
A single file and an output directory take the same path: written under ``<name>.tmp-<id>``, renamed.
A directory the commit needs and creates (the root, a target's parent) is made durable too: the parent
of each directory created is fsync'd (:meth:`RenameCommit.make_directory`), else a crash could take a
whole new root away with the steps committed in it.
"""

from __future__ import annotations

from typing import Callable

from ..read.committed import is_committed
from ..errors import CheckpointExistsError
from ..format import DATA_DIR, MANIFEST_NAME, OLD_MARK, TMP_MARK, aside_name, attempt_name
from ..storage import Location
from .base import Attempt, CommitStrategy, DirectoryAttempt, log, new_tag, refuse_existing


class RenameCommit(CommitStrategy):
    """Temporary name, fsync, rename (see the module docstring)."""

    kind = "rename"

    def make_directory(self, location: Location) -> None:
        """Create ``location`` and its missing parents, each one's entry fsync'd in its parent."""
        missing, current = [], location
        while not current.is_dir() and current.parent.path != current.path:
            missing.append(current)
            current = current.parent
        location.storage.makedirs(location.path)
        for created in reversed(missing):
            location.storage.sync_dir(created.parent.path)

    # -- a checkpoint directory ------------------------------------------------------------------
    def begin(self, target: Location, *, overwrite: bool) -> Attempt:
        self.make_directory(target.parent)
        self.collect_garbage(target)
        refuse_existing(target, overwrite=overwrite)
        tmp = target.parent / attempt_name(target.name, new_tag())
        target.storage.makedirs((tmp / DATA_DIR).path)
        return Attempt(target, tmp, overwrite=overwrite)

    def finish(self, attempt: Attempt, raw: bytes, referenced: set[str], *, overwrite: bool,
               fence: Callable[[], None] | None = None) -> None:
        storage, tmp = attempt.target.storage, attempt.directory
        storage.sync_dir((tmp / DATA_DIR).path)
        storage.write_bytes((tmp / MANIFEST_NAME).path, raw)
        storage.sync_dir(tmp.path)
        if fence is not None:  # the root still the writer's (flock cannot be lost; a lease can)
            fence()
        self.rename_into_place(tmp, attempt.target, overwrite=overwrite)

    def abort(self, attempt: Attempt) -> None:
        attempt.target.storage.remove_tree(attempt.directory.path)

    def rename_into_place(self, tmp: Location, target: Location, *, overwrite: bool) -> None:
        """The commit point: rename ``tmp`` to ``target``; what is there already and cannot be
        replaced atomically (a directory, or anything ``tmp`` being a directory) is moved aside
        first and deleted once the new one is in place."""
        storage = target.storage
        old = None
        if target.exists():
            if not overwrite:
                raise CheckpointExistsError(f"{target} appeared while saving; not replaced", path=str(target))
            if target.is_dir() or tmp.is_dir():
                old = target.parent / aside_name(target.name, new_tag())
                storage.rename(target.path, old.path)
        storage.rename(tmp.path, target.path)
        storage.sync_dir(target.parent.path)
        if old is not None:
            storage.remove_tree(old.path)

    # -- leftovers -------------------------------------------------------------------------------
    def collect_garbage(self, target: Location) -> None:
        """Delete the ``.tmp-`` entries of ``target``; restore a committed copy a crash left moved
        aside (when ``target`` is gone), else delete it."""
        storage, parent, name = target.storage, target.parent, target.name
        entries = parent.list()
        for entry in entries:
            if entry.startswith(name + TMP_MARK):
                log.info("removing stale tmp entry %s", parent / entry)
                storage.remove_tree((parent / entry).path)
        for entry in sorted(e for e in entries if e.startswith(name + OLD_MARK)):
            old = parent / entry
            if not target.exists() and (old / MANIFEST_NAME).is_file():
                log.warning("restoring %s from %s (a replacing save died mid-commit)", target, old)
                storage.rename(old.path, target.path)
                storage.sync_dir(parent.path)
            else:
                storage.remove_tree(old.path)

    def collect_uncommitted(self, path: Location) -> None:
        if path.is_dir() and not is_committed(path):
            log.info("removing %s: no manifest (an interrupted deletion)", path)
            self.delete(path)

    # -- one file --------------------------------------------------------------------------------
    def begin_file(self, target: Location, *, overwrite: bool) -> Location:
        self.make_directory(target.parent)
        self.collect_garbage(target)
        refuse_existing(target, overwrite=overwrite)
        return target.parent / attempt_name(target.name, new_tag())

    def publish_file(self, written: Location, target: Location, *, overwrite: bool) -> None:
        self.rename_into_place(written, target, overwrite=overwrite)

    # -- a directory that is not a checkpoint ----------------------------------------------------
    def begin_directory(self, target: Location, *, overwrite: bool) -> DirectoryAttempt:
        self.make_directory(target.parent)
        self.collect_garbage(target)  # leftovers of dead writes of the same target
        refuse_existing(target, overwrite=overwrite)
        tmp = target.parent / attempt_name(target.name, new_tag())
        target.storage.makedirs(tmp.path)
        return DirectoryAttempt(target, tmp, overwrite)

    def publish_directory(self, attempt: DirectoryAttempt, written: set[str]) -> None:
        attempt.target.storage.sync_dir(attempt.directory.path)
        self.rename_into_place(attempt.directory, attempt.target, overwrite=attempt.overwrite)

    def abort_directory(self, attempt: DirectoryAttempt, written: set[str]) -> None:
        attempt.target.storage.remove_tree(attempt.directory.path)

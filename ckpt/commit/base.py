"""What a commit strategy is: the interface every kind of mount implements, and what they share.

A strategy makes three kinds of output visible whole or not at all (see :mod:`ckpt.commit`):

* a checkpoint directory (:class:`Attempt`): ``begin`` → the ranks write data files under
  ``attempt.directory``, named with ``attempt.tag`` → ``finish`` writes the manifest last (the
  commit point), or ``abort`` removes what the attempt wrote;
* one file (``begin_file`` → the caller writes the path it returns → ``publish_file``);
* a directory that is not a checkpoint, such as a sharded export (:class:`DirectoryAttempt`:
  ``begin_directory`` → files written → ``publish_directory`` / ``abort_directory``).

It also knows what dead attempts leave behind and how to remove it (``collect_garbage``,
``collect_uncommitted``). Deleting a committed checkpoint is the same everywhere (:meth:`delete`:
the manifest first). A strategy holds no state: one instance serves every mount of its kind.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Callable

from ..errors import CheckpointExistsError
from ..format import MANIFEST_NAME
from ..storage import Location

log = logging.getLogger("ckpt.commit")


@dataclass(frozen=True)
class Attempt:
    """One save of ``target`` in progress: its files go under ``directory``, data files named with
    ``tag`` (empty on POSIX, where the tmp directory already isolates the attempt)."""

    target: Location
    directory: Location
    tag: str = ""
    overwrite: bool = False


@dataclass
class DirectoryAttempt:
    """An output directory being written (not a checkpoint): its files go under ``directory``;
    ``before`` holds the names an existing ``target`` had (object stores write in place)."""

    target: Location
    directory: Location
    overwrite: bool
    before: set[str] = field(default_factory=set)


def new_tag() -> str:
    """A name unique to one attempt (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def refuse_existing(target: Location, *, overwrite: bool, committed_only: bool = False) -> None:
    """Refuse to replace ``target`` unless ``overwrite`` (with ``committed_only``: only a
    committed checkpoint there counts)."""
    there = (target / MANIFEST_NAME).is_file() if committed_only else target.exists()
    if there and not overwrite:
        raise CheckpointExistsError(f"{target} already exists; pass overwrite=True to replace it", path=str(target))


class CommitStrategy:
    """How one kind of mount makes an output visible whole (see the module docstring)."""

    kind = "abstract"

    def make_directory(self, location: Location) -> None:
        """Create the directory ``location`` (and its missing parents) so that it lasts: what is
        committed inside it then survives a crash with it (see :class:`~ckpt.commit.posix.RenameCommit`)."""
        location.storage.makedirs(location.path)

    # -- a checkpoint directory ------------------------------------------------------------------
    def begin(self, target: Location, *, overwrite: bool) -> Attempt:
        """Clean up after dead saves of ``target``, refuse to replace it unless ``overwrite``, and
        start a fresh attempt."""
        raise NotImplementedError

    def finish(self, attempt: Attempt, raw: bytes, referenced: set[str], *, overwrite: bool,
               fence: Callable[[], None] | None = None) -> None:
        """The commit point: the manifest ``raw`` (which references the data files ``referenced``)
        written last, making the attempt visible as its target; ``fence()``, when given, right
        before it (it raises when the writer lost the root: nothing is committed)."""
        raise NotImplementedError

    def abort(self, attempt: Attempt) -> None:
        """Remove what a failed attempt wrote (safe to call twice)."""
        raise NotImplementedError

    # -- leftovers -------------------------------------------------------------------------------
    def collect_garbage(self, target: Location) -> None:
        """Delete what dead attempts at ``target`` left behind."""
        raise NotImplementedError

    def collect_uncommitted(self, path: Location) -> None:
        """Start-up clean-up of one step directory of a root: what is there without a manifest (an
        interrupted deletion, a save that never committed) goes."""
        raise NotImplementedError

    def delete(self, path: Location) -> None:
        """Delete a committed checkpoint: the manifest goes first, so a crash mid-way leaves no
        half-deleted checkpoint that readers could mistake for a whole one."""
        storage = path.storage
        manifest = path / MANIFEST_NAME
        if manifest.is_file():
            storage.remove(manifest.path)
            try:
                storage.sync_dir(path.path)
            except FileNotFoundError:
                # our own run's start-up clean-up took the rest (a directory without a manifest):
                # what is asked, the step gone, is done
                return
        storage.remove_tree(path.path)

    # -- one file --------------------------------------------------------------------------------
    def begin_file(self, target: Location, *, overwrite: bool) -> Location:
        """Where to write the file that will become ``target``."""
        raise NotImplementedError

    def publish_file(self, written: Location, target: Location, *, overwrite: bool) -> None:
        """Make the finished (closed) file ``written`` visible as ``target``."""
        raise NotImplementedError

    # -- a directory that is not a checkpoint ----------------------------------------------------
    def begin_directory(self, target: Location, *, overwrite: bool) -> DirectoryAttempt:
        raise NotImplementedError

    def publish_directory(self, attempt: DirectoryAttempt, written: set[str]) -> None:
        """Make the directory visible as its target; ``written``: the names of the files written."""
        raise NotImplementedError

    def abort_directory(self, attempt: DirectoryAttempt, written: set[str]) -> None:
        raise NotImplementedError

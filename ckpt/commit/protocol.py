"""The commit protocol's verbs on a location, each done by the strategy of the location's mount.

The storage says which strategy it takes: a mount that renames directories atomically
(:attr:`~ckpt.storage.Storage.atomic_rename`) takes :class:`~ckpt.commit.posix.RenameCommit`,
any other :class:`~ckpt.commit.object_store.ManifestLastCommit`. This is the only place that asks.
Every verb takes a :class:`~ckpt.storage.Location`: the caller resolved the path or URL at its door.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..format import Manifest, leftover_target
from ..storage import Location, Storage
from .base import Attempt, CommitStrategy
from .object_store import ManifestLastCommit
from .posix import RenameCommit

RENAME = RenameCommit()
MANIFEST_LAST = ManifestLastCommit()


def strategy_for(storage: Storage) -> CommitStrategy:
    """The commit strategy of ``storage``'s kind of mount."""
    return RENAME if storage.atomic_rename else MANIFEST_LAST


def make_directory(location: Location) -> None:
    """Create the directory ``location`` (a root) so that it lasts as what is committed in it does (on
    POSIX the parent of each directory created is fsync'd)."""
    strategy_for(location.storage).make_directory(location)


def begin(target: Location, *, overwrite: bool) -> Attempt:
    """Clean up after earlier dead saves of ``target``, refuse to replace it unless asked, and start
    a fresh attempt: write the data files under ``attempt.directory``, named with ``attempt.tag``."""
    return strategy_for(target.storage).begin(target, overwrite=overwrite)


def finish(attempt: Attempt, manifest: Manifest, *, overwrite: bool | None = None, raw: bytes | None = None,
           fence: Callable[[], None] | None = None) -> None:
    """Make the fully written attempt visible as its target (the commit point). ``raw``: the
    manifest's bytes when they already exist (a replica gets the primary's manifest bitwise);
    ``overwrite`` defaults to the attempt's; ``fence``: called right before the commit point, it
    raises when the writer no longer holds the root (a lost lease), and nothing is committed."""
    raw = manifest.to_json() if raw is None else raw
    overwrite = attempt.overwrite if overwrite is None else overwrite
    strategy_for(attempt.target.storage).finish(attempt, raw, manifest.data_files(), overwrite=overwrite, fence=fence)


def abort(attempt: Attempt) -> None:
    """Remove what a failed attempt wrote (safe to call twice)."""
    strategy_for(attempt.target.storage).abort(attempt)


@contextmanager
def attempting(target: Location, *, overwrite: bool) -> Iterator[Attempt]:
    """:func:`begin`; the block writes the data files and calls :func:`finish`; an error aborts::

        with commit.attempting(dst, overwrite=False) as attempt:
            ...                                   # data files under attempt.directory
            commit.finish(attempt, manifest)      # the commit point
    """
    attempt = begin(target, overwrite=overwrite)
    try:
        yield attempt
    except BaseException:
        abort(attempt)
        raise


def collect_garbage(target: Location) -> None:
    """Delete leftovers of dead saves of ``target``; on POSIX, restore a committed copy moved aside
    by a crash; on object stores, delete data objects its manifest does not reference (all of them
    when it has none)."""
    strategy_for(target.storage).collect_garbage(target)


def collect_root_garbage(root: Location) -> None:
    """:func:`collect_garbage` for every target under ``root`` that has leftovers by name (one
    listing; the step directories themselves are :func:`collect_uncommitted`'s)."""
    targets = {target for target in map(leftover_target, root.list()) if target is not None}
    for name in sorted(targets):
        collect_garbage(root / name)


def collect_uncommitted(path: Location) -> None:
    """Start-up clean-up of one step directory: whatever is there without a manifest (an interrupted
    deletion; on object stores also a save that never committed) is deleted; on object stores the
    data objects a committed one does not reference go too."""
    strategy_for(path.storage).collect_uncommitted(path)


def delete(path: Location) -> None:
    """Delete a committed checkpoint: the manifest goes first, so a crash mid-way leaves no
    half-deleted checkpoint that readers could mistake for a whole one."""
    strategy_for(path.storage).delete(path)

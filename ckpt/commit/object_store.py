"""The commit strategy of object stores (S3 and other fsspec mounts: no rename, no fsync): objects
written in place under names no other attempt uses, the one object that makes them visible written
last (the model: orbax's ``CommitFileTemporaryPath``).

A checkpoint's data objects go straight under ``<name>/data/``, named with a tag unique to the
attempt (``data/<tag>.rank-00000.bin``), so two attempts' objects never mix; each upload is completed
and its size checked before the rank reports success. The manifest is then written in one PUT
(atomic): the commit point, right before which the writer's fence (``fence``: its lease on the root
still its own, :mod:`ckpt.storage.lease`) is checked — a writer that lost the root commits nothing.

Where the store enforces conditional writes (S3: the lease needs them too), the manifest PUT is
itself a compare-and-swap against the manifest the attempt saw when it began: ``If-None-Match: *``
for a new step, ``If-Match: <etag>`` for an overwrite. A writer paused between its fence and its
PUT (past its lease, taken over) therefore never replaces a step another writer committed meanwhile:
its PUT is refused and it raises :class:`~ckpt.errors.CheckpointLockedError` (a refusal of the
client's retry of a PUT that landed is told apart: the manifest there is this attempt's own). Right
after its PUT the writer checks its fence again: a writer that lost the root meanwhile made a stray
commit, and when the new holder's start-up already removed its objects (as a dead attempt's) it
deletes that manifest again (If-Match: only while it is still its own) and fails. After an overwrite
the objects go that only the *replaced* manifest referenced (as read at ``begin``) — never objects
of unknown attempts: another writer's upload in progress, or a step it committed, is never deleted
by this one. A prefix without a manifest does not exist for readers; objects no manifest references
(a dead attempt's) are deleted by the next writer of the target or at start-up, under a held lease;
a failed attempt removes only its own objects (never the prefix: another writer's may be there),
and none that a committed manifest references: nothing past the commit point fails the save or
takes its objects away (a clean-up failure there is logged). What is left of the window (docs/STORAGE.md): a paused writer's PUT of a step nobody committed
meanwhile lands (one stray commit, which stays when its objects are all there); a writer paused
between a fence and a deletion (its start-up or ``begin`` clean-up) can still remove another
writer's upload in progress.

A single file is one upload that appears whole when it completes. An output directory that is not a
checkpoint is written in place, the file that makes it usable (an index) last; an overwrite then
removes the files of the old output that were not rewritten, a failure the files it added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..read.committed import MAX_MANIFEST_BYTES, read_manifest
from ..errors import CheckpointError, CheckpointLockedError
from ..format import DATA_DIR, MANIFEST_NAME, Manifest, parse_manifest
from ..storage import Location
from .base import Attempt, CommitStrategy, DirectoryAttempt, log, new_tag, refuse_existing


@dataclass(frozen=True)
class ManifestAttempt(Attempt):
    """An attempt with the manifest it may replace, as it was at ``begin``: ``replaces`` its ETag
    (None: there was none, or the store has no conditional writes) and ``replaced_files`` the data
    objects it referenced (what an overwrite removes once committed)."""

    replaces: str | None = None
    replaced_files: frozenset[str] = frozenset()
    conditional: bool = False


class ManifestLastCommit(CommitStrategy):
    """Attempt-tagged objects, the manifest last (see the module docstring)."""

    kind = "manifest-last"

    # -- a checkpoint directory ------------------------------------------------------------------
    def begin(self, target: Location, *, overwrite: bool) -> Attempt:
        target.storage.makedirs(target.parent.path)
        self.collect_garbage(target)
        refuse_existing(target, overwrite=overwrite, committed_only=True)
        conditional = target.storage.conditional_writes(target.parent.path)
        replaces, files = _replaced(target, conditional) if overwrite else (None, frozenset())
        return ManifestAttempt(target, target, new_tag(), overwrite=overwrite, replaces=replaces,
                               replaced_files=files, conditional=conditional)

    def finish(self, attempt: Attempt, raw: bytes, referenced: set[str], *, overwrite: bool,
               fence: Callable[[], None] | None = None) -> None:
        target = attempt.target
        refuse_existing(target, overwrite=overwrite, committed_only=True)
        if fence is not None:  # the writer still holds the root's lease, or nothing is committed
            fence()
        manifest = (target / MANIFEST_NAME).path
        if getattr(attempt, "conditional", False):  # the commit point is a compare-and-swap
            etag = target.storage.write_if(manifest, raw, etag=attempt.replaces) or _own_version(target, raw)
            if etag is None:
                raise CheckpointLockedError(
                    f"{target} was committed by another writer after this save began (one that took "
                    "the root over while this one was paused); nothing of this save was committed",
                    path=str(target))
            if fence is not None:
                _take_back_a_stray_commit(target, referenced, etag, fence)
        else:
            target.storage.write_bytes(manifest, raw)
        try:  # past the commit point nothing may fail the save: the caller's abort would remove its objects
            _remove_replaced(target, set(getattr(attempt, "replaced_files", ())) - set(referenced))
        except CheckpointError as exc:
            log.warning("%s: the objects of the manifest it replaced stay until the next clean-up (%s)", target, exc)

    def abort(self, attempt: Attempt) -> None:
        """Remove this attempt's own objects only: another writer may be saving the same target
        (the one that took the root's lease from a paused holder), and what it wrote is not ours."""
        target, storage = attempt.target, attempt.target.storage
        data = target / DATA_DIR
        committed = _readable_manifest(target)  # an error after this attempt's commit point leaves it whole
        keep = committed.data_files() if committed is not None else set()
        for name in data.list():
            if name.startswith(attempt.tag + ".") and f"{DATA_DIR}/{name}" not in keep:
                storage.remove((data / name).path)

    # -- leftovers -------------------------------------------------------------------------------
    def collect_garbage(self, target: Location) -> None:
        """Delete the data objects under ``target`` that its manifest does not reference: all of
        them (the whole prefix) when it has none."""
        manifest = _readable_manifest(target)
        if manifest is None and not (target / MANIFEST_NAME).is_file():
            if target.is_dir():
                log.info("removing %s: a save that never committed", target)
                target.storage.remove_tree(target.path)
        elif manifest is not None:
            _remove_unreferenced(target, manifest.data_files())

    def collect_uncommitted(self, path: Location) -> None:
        self.collect_garbage(path)

    # -- one file --------------------------------------------------------------------------------
    def begin_file(self, target: Location, *, overwrite: bool) -> Location:
        target.storage.makedirs(target.parent.path)
        refuse_existing(target, overwrite=overwrite)
        return target

    def publish_file(self, written: Location, target: Location, *, overwrite: bool) -> None:
        """Nothing left to do: the upload appeared whole when it completed."""

    # -- a directory that is not a checkpoint ----------------------------------------------------
    def begin_directory(self, target: Location, *, overwrite: bool) -> DirectoryAttempt:
        existed = target.exists()
        refuse_existing(target, overwrite=overwrite)
        before = set(target.list()) if existed else set()
        target.storage.makedirs(target.path)
        return DirectoryAttempt(target, target, overwrite, before)

    def publish_directory(self, attempt: DirectoryAttempt, written: set[str]) -> None:
        storage = attempt.target.storage
        for name in sorted(attempt.before - written):  # an overwritten output's other files
            if storage.is_file((attempt.target / name).path):
                storage.remove((attempt.target / name).path)

    def abort_directory(self, attempt: DirectoryAttempt, written: set[str]) -> None:
        for name in sorted(written - attempt.before):
            attempt.target.storage.remove((attempt.target / name).path)


def _replaced(target: Location, conditional: bool) -> tuple[str | None, frozenset[str]]:
    """The manifest an overwrite of ``target`` replaces: its ETag (where the store has conditional
    writes) and its data objects; an unreadable one references nothing (the start-up collects)."""
    etag = None
    if conditional:
        found = target.storage.read_tagged((target / MANIFEST_NAME).path, MAX_MANIFEST_BYTES)
        if found is None:
            return None, frozenset()
        raw, etag = found
        try:
            manifest = parse_manifest(raw, source=str(target / MANIFEST_NAME))
        except CheckpointError:
            manifest = None
    else:
        manifest = _readable_manifest(target)
    return etag, frozenset(manifest.data_files()) if manifest is not None else frozenset()


def _own_version(target: Location, raw: bytes) -> str | None:
    """The ETag of the manifest there when it is this attempt's (``raw`` names its attempt-tagged
    objects): a PUT whose first try landed, then was retried by the client, is refused by its own
    condition."""
    found = target.storage.read_tagged((target / MANIFEST_NAME).path, MAX_MANIFEST_BYTES)
    return found[1] if found is not None and found[0] == raw else None


def _take_back_a_stray_commit(target: Location, referenced: set[str], etag: str, fence: Callable[[], None]) -> None:
    """The fence once more, right after the commit point. A writer that lost the root while paused
    before its PUT made a stray commit; when the new holder has already removed its objects (as a
    dead attempt's) the step could never load, so its manifest is deleted again — only while it is
    still this one (If-Match) — and the save fails. A stray commit whose objects are all there stays."""
    try:
        fence()
    except CheckpointLockedError:
        storage, present = target.storage, set((target / DATA_DIR).list())
        if {f"{DATA_DIR}/{name}" for name in present} >= set(referenced):
            return
        if storage.conditional_deletes(target.parent.path):
            storage.delete_if((target / MANIFEST_NAME).path, etag)
        raise
    except CheckpointError as exc:  # the fence unreadable now: the commit stands
        log.warning("%s: committed; the lock could not be read back after it (%s)", target, exc)


def _remove_replaced(target: Location, files: set[str]) -> None:
    """Remove the data objects of the manifest this commit replaced that the new one does not reference."""
    for name in sorted(files):
        if name.startswith(f"{DATA_DIR}/"):
            log.info("removing %s: the manifest that referenced it was replaced", target / name)
            target.storage.remove((target / name).path)


def _remove_unreferenced(target: Location, referenced: set[str]) -> None:
    data = target / DATA_DIR
    for name in data.list():
        if f"{DATA_DIR}/{name}" not in referenced:
            log.info("removing %s: no manifest references it", data / name)
            target.storage.remove((data / name).path)


def _readable_manifest(target: Location) -> Manifest | None:
    try:
        return read_manifest(target)
    except CheckpointError:
        return None

"""The commit protocol: a checkpoint is visible complete or not at all, on every kind of mount.

A checkpoint directory is committed exactly when it holds ``manifest.json``; the manifest is always
the last thing written. The strategy depends on the mount (:attr:`Storage.atomic_rename`):

POSIX (local disk, NFS, Lustre: atomic rename):

1. All ranks write under ``<parent>/<name>.tmp-<id>/`` (chosen by the coordinator and handed to every
   rank in its plan); each rank fsyncs each of its data files before reporting success.
2. The coordinator, after every rank reported, fsyncs ``data/`` and the tmp directory, writes
   ``manifest.json`` there and fsyncs it.
3. It renames the tmp directory to ``<name>`` and fsyncs the parent. The rename is the commit point.

   A dead save leaves at most a ``.tmp-`` directory, which the next writer of the same target (or a
   manager starting on the root) deletes. Overwriting a committed target (only when asked) moves it
   aside to ``<name>.old-<id>`` first and deletes it after the new one is in place; if a crash strikes
   between the two renames, the next writer moves the old copy back.

Object stores (S3 and other fsspec mounts: no rename, no fsync):

1. All ranks write their data objects straight under ``<name>/data/``, named with a tag unique to the
   attempt (``data/<tag>.rank-00000.bin``), so objects of two attempts never mix; each upload is
   completed and its size checked before the rank reports success.
2. The coordinator writes ``<name>/manifest.json`` (one PUT: atomic). That is the commit point. When
   it replaced an older manifest (an overwrite), the objects only the old one referenced go next.

   A prefix without a manifest does not exist for readers. Objects no manifest references — a dead
   attempt's — are deleted by the next writer of the target or a manager starting on the root.

Whether a directory is committed (:func:`is_committed`, :func:`uncommitted_reason`) is the reader's
side of this protocol; it lives in :mod:`ckpt.committed`, below this module and the read side, and is
importable from here too. Every name above is made in :mod:`ckpt.format.names`.

A single-file checkpoint (:mod:`ckpt.merged`) is a :class:`PendingFile`: on POSIX written and fsync'd
under ``<name>.tmp-<id>`` and renamed over the target; on an object store one upload that appears
whole when it completes.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass

from .committed import is_committed, read_manifest, uncommitted_reason  # noqa: F401 (re-exported: the reader's side)
from .errors import CheckpointError, CheckpointExistsError
from .format import DATA_DIR, MANIFEST_NAME, OLD_MARK, TMP_MARK, Manifest, aside_name, attempt_name, leftover_target
from .storage import Location, locate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Attempt:
    """One save of ``target`` in progress: its files go under ``directory``, data files named with
    ``tag`` (empty on POSIX, where the tmp directory already isolates the attempt)."""

    target: Location
    directory: Location
    tag: str = ""


def _new_tag() -> str:
    return uuid.uuid4().hex[:12]


def _refuse_existing(target: Location, *, overwrite: bool) -> None:
    if not overwrite and (target / MANIFEST_NAME).is_file():
        raise CheckpointExistsError(f"{target} already exists; pass overwrite=True to replace it", path=str(target))


def begin(target: Location | str | os.PathLike, *, overwrite: bool) -> Attempt:
    """Clean up after earlier dead saves of ``target``, refuse to replace it unless asked, and start
    a fresh attempt (see the module docstring)."""
    target = locate(target)
    storage = target.storage
    storage.makedirs(target.parent.path)
    collect_garbage(target)
    if not storage.atomic_rename:
        _refuse_existing(target, overwrite=overwrite)
        return Attempt(target, target, _new_tag())
    if target.exists() and not overwrite:
        raise CheckpointExistsError(f"{target} already exists; pass overwrite=True to replace it", path=str(target))
    tmp = target.parent / attempt_name(target.name, _new_tag())
    storage.makedirs((tmp / DATA_DIR).path)
    return Attempt(target, tmp)


def finish(attempt: Attempt, manifest: Manifest, *, overwrite: bool, raw: bytes | None = None) -> None:
    """Make the fully written attempt visible as its target (the commit point). ``raw``: the
    manifest's bytes when they already exist (a replica gets the primary's manifest bitwise)."""
    target, storage = attempt.target, attempt.target.storage
    raw = manifest.to_json() if raw is None else raw
    if not storage.atomic_rename:
        _refuse_existing(target, overwrite=overwrite)
        storage.write_bytes((target / MANIFEST_NAME).path, raw)
        _remove_unreferenced(target, manifest.data_files())
        return
    tmp = attempt.directory
    storage.sync_dir((tmp / DATA_DIR).path)
    storage.write_bytes((tmp / MANIFEST_NAME).path, raw)
    storage.sync_dir(tmp.path)
    _publish(tmp, target, overwrite=overwrite)


def _publish(tmp: Location, target: Location, *, overwrite: bool) -> None:
    """POSIX commit point: rename ``tmp`` to ``target``; a directory already there is moved aside
    first (it cannot be replaced atomically) and deleted once the new one is in place."""
    storage = target.storage
    old = None
    if target.exists():
        if not overwrite:
            raise CheckpointExistsError(f"{target} appeared while saving; not replaced", path=str(target))
        if target.is_dir():
            old = target.parent / aside_name(target.name, _new_tag())
            storage.rename(target.path, old.path)
    storage.rename(tmp.path, target.path)
    storage.sync_dir(target.parent.path)
    if old is not None:
        storage.remove_tree(old.path)


def abort(attempt: Attempt) -> None:
    """Remove what a failed attempt wrote (safe to call twice)."""
    storage = attempt.target.storage
    if storage.atomic_rename:
        storage.remove_tree(attempt.directory.path)
        return
    if not (attempt.target / MANIFEST_NAME).is_file():
        storage.remove_tree(attempt.target.path)
        return
    data = attempt.target / DATA_DIR
    for name in data.list():
        if name.startswith(attempt.tag + "."):
            storage.remove((data / name).path)


def _remove_unreferenced(target: Location, referenced: set[str]) -> None:
    """Object stores: delete data objects under ``target`` that its manifest does not reference."""
    data = target / DATA_DIR
    for name in data.list():
        if f"{DATA_DIR}/{name}" not in referenced:
            log.info("removing %s: no manifest references it", data / name)
            target.storage.remove((data / name).path)


class PendingFile:
    """A single-file checkpoint being written, published whole by :meth:`publish` or removed by
    :meth:`abort` (see the module docstring)."""

    def __init__(self, target: Location | str | os.PathLike, *, overwrite: bool):
        self.target = target = locate(target)
        self.overwrite = overwrite
        storage = target.storage
        storage.makedirs(target.parent.path)
        if storage.atomic_rename:
            collect_garbage(target)
            self.tmp = target.parent / attempt_name(target.name, _new_tag())
        else:
            self.tmp = target
        if not overwrite and target.exists():
            raise CheckpointExistsError(f"{target} already exists; pass overwrite=True to replace it",
                                        path=str(target))
        self._handle = storage.create(self.tmp.path)

    def write(self, data) -> None:
        self._handle.write(data)

    def publish(self) -> None:
        self._handle.close()
        if self.tmp != self.target:
            _publish(self.tmp, self.target, overwrite=self.overwrite)

    def abort(self) -> None:
        self._handle.abort()


def collect_garbage(target: Location | str | os.PathLike) -> None:
    """Delete leftovers of dead saves of ``target``; on POSIX, restore a committed copy moved aside
    by a crash; on object stores, delete data objects its manifest does not reference (all of them
    when it has none)."""
    target = locate(target)
    storage = target.storage
    if not storage.atomic_rename:
        manifest = _readable_manifest(target)
        if manifest is None and not (target / MANIFEST_NAME).is_file():
            if target.is_dir():
                log.info("removing %s: a save that never committed", target)
                storage.remove_tree(target.path)
        elif manifest is not None:
            _remove_unreferenced(target, manifest.data_files())
        return
    parent, name = target.parent, target.name
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


def _readable_manifest(target: Location) -> Manifest | None:
    try:
        return read_manifest(target)
    except CheckpointError:
        return None


def collect_root_garbage(root: Location | str | os.PathLike) -> None:
    """:func:`collect_garbage` for every target under ``root`` that has leftovers (manager start-up;
    on object stores the caller passes every step, see :meth:`ckpt.root.CheckpointRoot.lock`)."""
    root = locate(root)
    targets = set()
    for entry in root.list():
        target = leftover_target(entry)
        if target is not None:
            targets.add(target)
    for name in sorted(targets):
        collect_garbage(root / name)


def delete(path: Location | str | os.PathLike) -> None:
    """Delete a committed checkpoint: the manifest goes first, so a crash mid-way leaves no
    half-deleted checkpoint that readers could mistake for a whole one."""
    path = locate(path)
    storage = path.storage
    manifest = path / MANIFEST_NAME
    if manifest.is_file():
        storage.remove(manifest.path)
        storage.sync_dir(path.path)
    storage.remove_tree(path.path)

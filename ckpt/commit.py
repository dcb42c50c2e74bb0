"""The commit protocol: a checkpoint is visible complete or not at all.

POSIX contract (local disk, NFS, Lustre and other file systems with atomic rename):

1. All ranks write under ``<parent>/<name>.tmp-<id>/`` (chosen by the coordinator and handed to every
   rank in its plan); each rank fsyncs each of its data files before reporting success.
2. The coordinator, after every rank reported, fsyncs ``data/`` and the tmp directory, writes
   ``manifest.json`` there and fsyncs it.
3. It renames the tmp directory to ``<name>`` and fsyncs the parent. The rename is the commit point.

A reader only opens directories named without ``.tmp-`` that hold a ``manifest.json``; a save that
died at any point leaves at most a ``.tmp-`` directory, which the next writer of the same target
(or a manager starting on the root) deletes. Overwriting a committed target (only when asked) moves
it aside to ``<name>.old-<id>`` first and deletes it after the new one is in place; if a crash
strikes between the two renames, the next writer moves the old copy back, so a committed target is
never lost.

A single-file checkpoint (:mod:`ckpt.merged`) follows the same steps with a :class:`PendingFile`:
written and fsync'd under ``<name>.tmp-<id>``, then renamed over the target (atomic for a file).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from .errors import CheckpointExistsError
from .fileio import fsync_dir, write_all, write_file_durably
from .format import DATA_DIR, MANIFEST_NAME

log = logging.getLogger(__name__)

TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


def uncommitted_reason(path: Path) -> str | None:
    """Why ``path`` is not a committed checkpoint directory (None when it is one)."""
    path = Path(path)
    if TMP_MARK in path.name or OLD_MARK in path.name:
        return f"{path} is the leftover of an unfinished save, not a checkpoint"
    if not path.is_dir():
        return f"no checkpoint at {path}"
    if not (path / MANIFEST_NAME).is_file():
        return f"{path} is not a committed checkpoint (no {MANIFEST_NAME})"
    return None


def is_committed(path: Path) -> bool:
    return uncommitted_reason(path) is None


def _claim(target: Path, *, overwrite: bool) -> Path:
    """Clean up after earlier dead saves of ``target``, refuse to replace it unless asked, and
    return a fresh tmp name beside it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    collect_garbage(target)
    if target.exists() and not overwrite:
        raise CheckpointExistsError(f"{target} already exists; pass overwrite=True to replace it", path=target)
    return target.parent / f"{target.name}{TMP_MARK}{uuid.uuid4().hex[:12]}"


def begin(target: Path, *, overwrite: bool) -> Path:
    """Create a fresh tmp directory for a save of ``target`` (see :func:`_claim`)."""
    tmp = _claim(Path(target), overwrite=overwrite)
    (tmp / DATA_DIR).mkdir(parents=True)
    return tmp


def finish(tmp: Path, target: Path, manifest: bytes, *, overwrite: bool) -> None:
    """Make the fully written ``tmp`` directory visible as ``target`` (steps 2 and 3 above)."""
    fsync_dir(tmp / DATA_DIR)
    write_file_durably(tmp / MANIFEST_NAME, manifest)
    fsync_dir(tmp)
    _publish(tmp, target, overwrite=overwrite)


def _publish(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """The commit point: rename ``tmp`` to ``target``; a directory already there is moved aside
    first (it cannot be replaced atomically) and deleted once the new one is in place."""
    old = None
    if target.exists():
        if not overwrite:
            raise CheckpointExistsError(f"{target} appeared while saving; not replaced", path=target)
        if target.is_dir():
            old = target.parent / f"{target.name}{OLD_MARK}{uuid.uuid4().hex[:12]}"
            os.rename(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    if old is not None:
        _remove(old)


def abort(tmp: Path) -> None:
    _remove(tmp)


def _remove(path: Path) -> None:
    if Path(path).is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


class PendingFile:
    """A single-file checkpoint being written: a fresh tmp file beside ``target``, published whole
    by :meth:`publish` (fsync, close, rename, fsync the parent) or removed by :meth:`abort`."""

    def __init__(self, target: str | os.PathLike, *, overwrite: bool):
        self.target, self.overwrite = Path(target), overwrite
        self.tmp = _claim(self.target, overwrite=overwrite)
        self._fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def write(self, data) -> None:
        write_all(self._fd, memoryview(data))

    def publish(self) -> None:
        os.fsync(self._fd)
        self._close()
        _publish(self.tmp, self.target, overwrite=self.overwrite)

    def abort(self) -> None:
        self._close()
        _remove(self.tmp)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def collect_garbage(target: Path) -> None:
    """Delete leftovers of dead saves of ``target``; restore a committed copy moved aside by a crash."""
    parent = Path(target).parent
    if not parent.is_dir():
        return
    name = Path(target).name
    for entry in parent.iterdir():
        if entry.name.startswith(name + TMP_MARK):
            log.info("removing stale tmp entry %s", entry)
            _remove(entry)
    for entry in sorted(parent.glob(name + OLD_MARK + "*")):
        if not target.exists() and (entry / MANIFEST_NAME).is_file():
            log.warning("restoring %s from %s (a replacing save died mid-commit)", target, entry)
            os.rename(entry, target)
            fsync_dir(parent)
        else:
            _remove(entry)


def collect_root_garbage(root: Path) -> None:
    """:func:`collect_garbage` for every target under ``root`` that has leftovers (manager start-up)."""
    root = Path(root)
    if not root.is_dir():
        return
    targets = set()
    for entry in root.iterdir():
        for mark in (TMP_MARK, OLD_MARK):
            if mark in entry.name:
                targets.add(entry.name.split(mark, 1)[0])
    for name in sorted(targets):
        collect_garbage(root / name)


def delete(path: Path) -> None:
    """Delete a committed checkpoint: the manifest goes first, so a crash mid-way leaves no
    half-deleted checkpoint that readers could mistake for a whole one."""
    path = Path(path)
    manifest = path / MANIFEST_NAME
    if manifest.exists():
        manifest.unlink()
        fsync_dir(path)
    shutil.rmtree(path, ignore_errors=True)

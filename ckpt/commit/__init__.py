"""The commit protocol: a checkpoint is visible complete or not at all, on every kind of mount.

A checkpoint directory is committed exactly when it holds ``manifest.json``; the manifest is always
the last thing written. How depends on the mount: one strategy object per kind of mount, chosen by
the storage (:func:`strategy_for`: :attr:`Storage.atomic_rename <ckpt.storage.Storage.atomic_rename>`).

POSIX (local disk, NFS, Lustre: atomic rename) — :class:`RenameCommit` (:mod:`ckpt.commit.posix`):

1. All ranks write under ``<parent>/<name>.tmp-<id>/`` (chosen by the coordinator and handed to every
   rank in its plan); each rank fsyncs each of its data files before reporting success.
2. The coordinator, after every rank reported, fsyncs ``data/`` and the tmp directory, writes
   ``manifest.json`` there and fsyncs it.
3. It renames the tmp directory to ``<name>`` and fsyncs the parent. The rename is the commit point.

   A dead save leaves at most a ``.tmp-`` directory, which the next writer of the same target (or a
   manager starting on the root) deletes. Overwriting a committed target (only when asked) moves it
   aside to ``<name>.old-<id>`` first and deletes it after the new one is in place; if a crash strikes
   between the two renames, the next writer moves the old copy back.

Object stores (S3 and other fsspec mounts: no rename, no fsync) — :class:`ManifestLastCommit`
(:mod:`ckpt.commit.object_store`):

1. All ranks write their data objects straight under ``<name>/data/``, named with a tag unique to the
   attempt (``data/<tag>.rank-00000.bin``), so objects of two attempts never mix; each upload is
   completed and its size checked before the rank reports success.
2. The coordinator writes ``<name>/manifest.json`` (one PUT: atomic). That is the commit point. When
   it replaced an older manifest (an overwrite), the objects only the old one referenced go next.

   A prefix without a manifest does not exist for readers. Objects no manifest references — a dead
   attempt's — are deleted by the next writer of the target or a manager starting on the root.

Deleting a committed checkpoint (:func:`delete`) removes its manifest first, so a crash mid-way
leaves a directory without a manifest, which readers never list and start-up clean-up removes
(:func:`collect_uncommitted`, on every mount a manager writes: :mod:`ckpt.root`).

The verbs (:mod:`ckpt.commit.protocol`): :func:`begin` / :func:`finish` / :func:`abort` (or
:func:`attempting`, a ``with`` block that aborts on error) for a checkpoint; :func:`collect_garbage`,
:func:`collect_root_garbage`, :func:`collect_uncommitted`, :func:`delete`; :func:`make_directory` (a
root, created so that it lasts: on POSIX each new directory's entry is fsync'd in its parent). Outputs that are not
checkpoints go through the same strategies (:mod:`ckpt.commit.publish`): :class:`PendingFile` (one
file, e.g. :mod:`ckpt.merged`'s) and :class:`PendingDirectory` (a directory of files, e.g. a sharded
export) — the offline converters' publish API.

Whether a directory is committed (:func:`is_committed`, :func:`uncommitted_reason`) is the reader's
side of this protocol; it lives in :mod:`ckpt.read.committed`, below this package and the read side, and is
importable from here too. Every name above is made in :mod:`ckpt.format.names`.
"""

from __future__ import annotations

from ..read.committed import is_committed, read_manifest, uncommitted_reason
from ..format import OLD_MARK, TMP_MARK
from .base import Attempt, CommitStrategy, DirectoryAttempt, new_tag
from .object_store import ManifestLastCommit
from .posix import RenameCommit
from .protocol import (MANIFEST_LAST, RENAME, abort, attempting, begin, collect_garbage, collect_root_garbage,
                       collect_uncommitted, delete, finish, make_directory, strategy_for)
from .publish import PendingDirectory, PendingFile

__all__ = [
    "Attempt", "DirectoryAttempt", "CommitStrategy", "RenameCommit", "ManifestLastCommit", "strategy_for", "RENAME",
    "MANIFEST_LAST",
    "begin", "finish", "abort", "attempting", "collect_garbage", "collect_root_garbage", "collect_uncommitted",
    "delete", "make_directory", "PendingFile", "PendingDirectory", "new_tag",
    "is_committed", "uncommitted_reason", "read_manifest", "TMP_MARK", "OLD_MARK",
]


"""A recording storage: every state-changing operation the engine does on a mount, in order, with its path.

    with recording(tmp_path / "root") as rec:               # local paths under it are recorded
        ckpt.save(state, tmp_path / "root" / "step-00000001")
    rec.verbs()   # [("makedirs", "step-00000001.tmp-…"), ("create", …/data/rank-00000.bin), ("write", …),
                  #  ("fsync", …/data/rank-00000.bin), ("fsync_dir", …/data), ..., ("rename", …), ...]

    with recording(f"{bucket}/run", scheme="s3") as rec:    # an object store: put, delete, list
        ...

:class:`RecordingStorage` wraps the storage ``locate()`` chose (through the engine's public seam,
``ckpt.storage.wrappers``) and records, for paths under one of its roots: ``makedirs``, ``create``,
``write`` (with the bytes), ``close``, ``write_bytes`` (with the bytes), ``rename`` (with the
destination), ``remove``, ``remove_tree``, ``sync_dir`` and ``list``. The storage interface has no
fsync of a file: on POSIX it happens inside :meth:`WriteHandle.close` and ``write_bytes``
(:mod:`ckpt.storage._posix_io`, :mod:`ckpt.storage.local`), so :func:`recording` also wraps
``os.fsync`` for the length of the block and records each call on a file under a root as ``fsync``
and on a directory as ``fsync_dir`` (the path from ``/proc/self/fd``). Nothing in the engine changes;
a mutant that drops an fsync shows as a missing ``fsync`` record.

Each record is an :class:`Op` (``kind``, ``path`` relative to its root, ``data``, ``dst``, ``seq``),
appended before the operation runs (an fsync done inside ``write_bytes`` therefore follows its ``write_bytes``).
The root's lock (``.lock``, renewed by a heartbeat thread on object stores) and the catalog
(``.catalog``) are not recorded: they are no part of the commit protocol. On an object store the
verbs read ``put`` (``write_bytes``, or the ``close`` that completes an upload), ``delete``
(``remove``), ``delete_tree`` and ``list``.

Several blocks may be open at once, on one scheme or several (a replication records two mounts): each
gets what falls under its roots, and ``seq`` orders the operations of all of them.

:mod:`tests.support.crashsim` replays a recording to build the states a crash after each operation
can leave.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import ckpt.storage
from ckpt.storage import Storage

IGNORED = (".lock", ".catalog")


_SEQ = itertools.count()  # one order across every recording (a replication writes two mounts)


@dataclass(frozen=True)
class Op:
    kind: str
    path: str
    data: bytes | None = None
    dst: str | None = None
    seq: int = 0

    def __repr__(self) -> str:
        extra = f" -> {self.dst}" if self.dst is not None else ""
        size = f" [{len(self.data)} B]" if self.data is not None else ""
        return f"{self.kind} {self.path}{extra}{size}"


class Recording:
    """The operations recorded under ``roots`` (normalised paths), in order; see the module docstring."""

    def __init__(self, roots: list[str], *, object_store: bool):
        self.roots = roots
        self.object_store = object_store
        self.ops: list[Op] = []
        self.lock = threading.Lock()

    def relative(self, path: str) -> str | None:
        path = _norm(path, self.object_store)
        for root in self.roots:
            if path == root:
                rel = "."
            elif path.startswith(root + "/"):
                rel = path[len(root) + 1:]
            else:
                continue
            if rel.split("/", 1)[0] in IGNORED:
                return None
            return rel
        return None

    def add(self, kind: str, path: str, data=None, dst: str | None = None) -> None:
        rel = self.relative(path)
        if rel is None:
            return
        with self.lock:
            self.ops.append(Op(kind, rel, None if data is None else bytes(data),
                               None if dst is None else self.relative(dst), next(_SEQ)))

    def verbs(self, *, lists: bool = False) -> list[tuple[str, str]]:
        """``(verb, path)`` per operation (the object-store names on an object store), listings only
        with ``lists``; ``write``/``create`` of an upload are left out on an object store (nothing is
        visible before its ``close``)."""
        out = []
        for op in self.ops:
            verb = (_OBJECT_VERBS if self.object_store else _LOCAL_VERBS).get(op.kind, op.kind)
            if verb is None or (verb == "list" and not lists):
                continue
            out.append((verb, op.path if op.dst is None else f"{op.path} -> {op.dst}"))
        return out


_OBJECT_VERBS = {"write_bytes": "put", "close": "put", "remove": "delete", "remove_tree": "delete_tree",
                 "create": None, "write": None, "makedirs": None, "sync_dir": None, "abort": None}
_LOCAL_VERBS = {"sync_dir": None, "close": None}  # the fsync_dir inside sync_dir is recorded itself


def _norm(path: str, object_store: bool) -> str:
    path = os.fspath(path)
    return path.rstrip("/") if object_store else os.path.realpath(path)


_ACTIVE: dict[str, list[Recording]] = {}  # scheme -> the recordings open on it (nested blocks: all of them)


class _Fanout:
    """What a storage wrapper records into: every recording open on its scheme (each keeps its roots)."""

    def __init__(self, scheme: str):
        self.scheme = scheme

    def add(self, *args, **kwargs) -> None:
        for rec in list(_ACTIVE.get(self.scheme, ())):
            rec.add(*args, **kwargs)


class RecordingWriter:
    def __init__(self, inner, recording: _Fanout, path: str):
        self.inner, self.recording, self.path = inner, recording, path

    def write(self, data) -> None:
        self.recording.add("write", self.path, memoryview(data).cast("B"))
        self.inner.write(data)

    def close(self) -> int:
        self.recording.add("close", self.path)  # before: the fsync inside follows it
        return self.inner.close()

    def abort(self) -> None:
        self.recording.add("abort", self.path)
        self.inner.abort()


class RecordingStorage(Storage):
    """``inner``'s operations, recorded into every recording open on its scheme (see the module
    docstring: nested blocks on one scheme each get what falls under their roots)."""

    def __init__(self, inner: Storage, recording: _Fanout):
        self.inner, self.recording = inner, recording
        self.scheme, self.is_local, self.atomic_rename = inner.scheme, inner.is_local, inner.atomic_rename

    def __getattr__(self, name):  # display, join, identity, lock, size, fs, ...
        return getattr(self.inner, name)

    def display(self, path): return self.inner.display(path)
    def join(self, path, name): return self.inner.join(path, name)
    def is_dir(self, path): return self.inner.is_dir(path)
    def is_file(self, path): return self.inner.is_file(path)
    def is_link(self, path): return self.inner.is_link(path)
    def exists(self, path): return self.inner.exists(path)
    def identity(self, path): return self.inner.identity(path)
    def directory_id(self, path): return self.inner.directory_id(path)
    def open_read(self, directory, name): return self.inner.open_read(directory, name)
    def read_bytes(self, directory, name, limit): return self.inner.read_bytes(directory, name, limit)
    def lock(self, path, *, holder): return self.inner.lock(path, holder=holder)

    def list(self, path):
        self.recording.add("list", path)
        return self.inner.list(path)

    def makedirs(self, path):
        self.recording.add("makedirs", path)
        self.inner.makedirs(path)

    def create(self, path):
        self.recording.add("create", path)
        return RecordingWriter(self.inner.create(path), self.recording, path)

    def write_bytes(self, path, data):
        self.recording.add("write_bytes", path, data)
        self.inner.write_bytes(path, data)

    def sync_dir(self, path):
        self.recording.add("sync_dir", path)
        self.inner.sync_dir(path)

    def rename(self, src, dst):
        self.recording.add("rename", src, dst=dst)
        self.inner.rename(src, dst)

    def remove(self, path):
        self.recording.add("remove", path)
        self.inner.remove(path)

    def remove_tree(self, path):
        self.recording.add("remove_tree", path)
        self.inner.remove_tree(path)


@contextlib.contextmanager
def recording(*roots, scheme: str = "file") -> Iterator[Recording]:
    """Record the operations on ``roots`` (local paths, or ``bucket/prefix`` paths of ``scheme``)
    for the length of the block; install before the manager or the save (see the module docstring)."""
    object_store = scheme != "file"
    rec = Recording([_norm(r, object_store) for r in roots], object_store=object_store)
    wrapped: dict[int, RecordingStorage] = {}

    def wrapper(inner: Storage) -> Storage:
        if id(inner) not in wrapped:
            wrapped[id(inner)] = RecordingStorage(inner, _Fanout(scheme))
        return wrapped[id(inner)]

    real_fsync = os.fsync

    def fsync(fd):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        except OSError:
            path = None
        if path is not None:
            rec.add("fsync_dir" if is_dir else "fsync", path)
        return real_fsync(fd)

    with contextlib.ExitStack() as stack:
        _ACTIVE.setdefault(scheme, []).append(rec)
        stack.callback(_ACTIVE[scheme].remove, rec)
        stack.enter_context(ckpt.storage.wrapped(scheme, wrapper))
        if not object_store:
            os.fsync = fsync
            stack.callback(setattr, os, "fsync", real_fsync)
        yield rec

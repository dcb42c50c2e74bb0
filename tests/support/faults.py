"""Fault injection for the storage seam: a mount that fills up, refuses, or goes away on command.

    faulty = install_faulty(monkeypatch, tmp_path / "nvme")   # paths under it now go through faulty
    faulty.disk_full(after=4096)      # ENOSPC once 4096 more bytes were written there
    faulty.deny("create")             # EACCES on create (also "makedirs", "rename")
    faulty.vanish()                   # every call raises, as on a mount that went away
    faulty.vanish(after=1000)         # ... once 1000 more bytes were written (mid-save)
    faulty.restore()                  # the fault clears: a healthy mount again
    faulty.injected                   # Counter of the faults raised, by kind

:class:`FaultyStorage` wraps a real :class:`~ckpt.storage.Storage` and delegates every method to it;
only paths under its ``root`` are subject to faults (anything else passes straight through).

* **disk full**: ``create(...).write`` and ``write_bytes`` write what still fits (a short write, as a
  full disk does) and raise ``OSError(ENOSPC, "No space left on device", path)``. ``after`` is the
  free space left when the fault is armed; bytes of files removed while it is armed are given back
  (``capacity=True``) or not (the default: the disk stays full until :meth:`restore`).
* **permission denied**: the named operations (``create``, ``makedirs``, ``rename``) raise
  ``PermissionError(EACCES)``; running as root, ``chmod`` would not stop the engine, so this is how
  the tests get EACCES.
* **vanished mount**: every call raises ``OSError(err, ..., path)`` (default ENOENT, a
  :class:`FileNotFoundError`, as for a path whose mount is gone; ``errno.ENOTCONN``/``EIO`` model a
  dead FUSE/NFS mount), listing included; with ``after=N`` the mount goes once N more bytes were
  written, in the middle of a file. A file being written when the mount vanishes is not removed by
  ``abort`` (the unlink cannot reach it): it is still there when the mount returns, as on a real
  mount. (A mount point that is really unmounted behaves differently: the directory underneath
  answers, empty and writable; the bind-mount test in tests/reliability/test_faults.py covers that.)

Installing: the engine resolves every plain path through ``ckpt.storage.locate``, which applies the
wrapper registered for the ``"file"`` scheme in ``ckpt.storage.wrappers`` (the engine's public seam).
:func:`install_faulty` registers one (with ``monkeypatch.setitem``, undone at teardown) that answers
with a :class:`PrefixRouter`: paths under a faulty root go to its :class:`FaultyStorage`, everything
else to the real local storage, so no engine code changes. Install before constructing the manager
(a :class:`~ckpt.storage.Location` keeps the storage it was made with).

A real size-limited file system is :mod:`tests.support.mounts`; an S3 server that comes back with
its data, :func:`tests.support.s3server.snapshot_bucket` / ``restore_bucket``.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import Counter

import ckpt.storage
from ckpt.storage import Storage

OPERATIONS = ("create", "makedirs", "rename")


def _abs(path) -> str:
    return os.path.abspath(os.fspath(path)).rstrip("/") or "/"


class FaultyStorage(Storage):
    """A real storage whose paths under ``root`` fail on command (see the module docstring)."""

    def __init__(self, inner: Storage, root: str | os.PathLike | None = None):
        self.inner = inner
        self.root = None if root is None else _abs(root)
        self.scheme, self.is_local, self.atomic_rename = inner.scheme, inner.is_local, inner.atomic_rename
        self._lock = threading.Lock()
        self.injected: Counter = Counter()
        self.written = 0  # bytes written under root through this storage
        self._space: int | None = None  # free bytes left while disk_full is armed
        self._give_back = False
        self._sizes: dict[str, int] = {}  # bytes written per file while disk_full is armed
        self._denied: set[str] = set()
        self._vanished: int | None = None
        self._vanish_after: tuple[int, int] | None = None  # (bytes left, errno): vanish mid-write

    # -- commands ------------------------------------------------------------------------------
    def disk_full(self, after: int = 0, *, capacity: bool = False) -> None:
        """ENOSPC once ``after`` more bytes were written; ``capacity``: removing files frees space."""
        with self._lock:
            self._space, self._give_back, self._sizes = max(0, after), capacity, {}

    def deny(self, *operations: str) -> None:
        """EACCES on ``operations`` (default: create, makedirs and rename)."""
        unknown = set(operations) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"cannot deny {sorted(unknown)}; one of {OPERATIONS}")
        with self._lock:
            self._denied = set(operations or OPERATIONS)

    def vanish(self, err: int = errno.ENOENT, *, after: int | None = None) -> None:
        """Every call under root raises ``OSError(err)`` until :meth:`restore`; with ``after``, only
        once ``after`` more bytes were written (the mount goes away in the middle of a save)."""
        with self._lock:
            if after is None:
                self._vanished = err
            else:
                self._vanish_after = (max(0, after), err)

    def restore(self) -> None:
        """Clear every fault: the mount is healthy again (what it holds is unchanged)."""
        with self._lock:
            self._space, self._sizes, self._denied, self._vanished = None, {}, set(), None
            self._vanish_after = None

    @property
    def vanished(self) -> bool:
        return self._vanished is not None

    # -- fault checks --------------------------------------------------------------------------
    def covers(self, path: str) -> bool:
        if self.root is None:
            return True
        path = _abs(path)
        return path == self.root or path.startswith(self.root + "/")

    def _raise(self, kind: str, code: int, path: str):
        with self._lock:
            self.injected[kind] += 1
        raise OSError(code, os.strerror(code), path)

    def _check(self, op: str, path: str) -> None:
        if not self.covers(path):
            return
        if self._vanished is not None:
            self._raise("vanished", self._vanished, path)
        if op in self._denied:
            self._raise(f"denied {op}", errno.EACCES, path)

    def _take(self, path: str, want: int) -> int:
        """Bytes of ``want`` that fit on the disk (all when no disk-full fault is armed); when a
        pending vanish is reached, the mount vanishes after what still fits."""
        if not self.covers(path):
            return want
        with self._lock:
            granted = want
            if self._vanish_after is not None:
                left, err = self._vanish_after
                granted = min(granted, left)
                self._vanish_after = (left - granted, err)
                if granted < want:
                    self._vanished, self._vanish_after = err, None
            if self._space is not None:
                granted = min(granted, self._space)
                self._space -= granted
                key = _abs(path)
                self._sizes[key] = self._sizes.get(key, 0) + granted
            self.written += granted
        return granted

    def _short(self, path: str) -> None:
        """A write came up short: the mount vanished, else the disk is full."""
        if self._vanished is not None:
            self._raise("vanished", self._vanished, path)
        self._raise("disk full", errno.ENOSPC, path)

    def _freed(self, path: str) -> None:
        if not self.covers(path):
            return
        with self._lock:
            if self._space is None or not self._give_back:
                return
            key = _abs(path)
            for name in [n for n in self._sizes if n == key or n.startswith(key + "/")]:
                self._space += self._sizes.pop(name)

    # -- Storage -------------------------------------------------------------------------------
    def display(self, path: str) -> str:
        return self.inner.display(path)

    def join(self, path: str, name: str) -> str:
        return self.inner.join(path, name)

    def identity(self, path: str) -> str:
        return self.inner.identity(path)

    def list(self, path: str) -> list[str]:
        self._check("list", path)
        return self.inner.list(path)

    def is_dir(self, path: str) -> bool:
        self._check("is_dir", path)
        return self.inner.is_dir(path)

    def is_file(self, path: str) -> bool:
        self._check("is_file", path)
        return self.inner.is_file(path)

    def is_link(self, path: str) -> bool:
        self._check("is_link", path)
        return self.inner.is_link(path)

    def exists(self, path: str) -> bool:
        self._check("exists", path)
        return self.inner.exists(path)

    def open_read(self, directory: str, name: str):
        self._check("open_read", self.join(directory, name))
        return FaultyReader(self, self.join(directory, name), self.inner.open_read(directory, name))

    def read_bytes(self, directory: str, name: str, limit: int) -> bytes:
        self._check("read_bytes", self.join(directory, name))
        return self.inner.read_bytes(directory, name, limit)

    def makedirs(self, path: str) -> None:
        self._check("makedirs", path)
        self.inner.makedirs(path)

    def create(self, path: str):
        self._check("create", path)
        return FaultyWriter(self, path, self.inner.create(path))

    def write_bytes(self, path: str, data: bytes) -> None:
        self._check("write_bytes", path)
        granted = self._take(path, len(data))
        if granted < len(data):  # what fits lands, as on a real full disk
            self.inner.write_bytes(path, bytes(data[:granted]))
            self._short(path)
        self.inner.write_bytes(path, data)

    def sync_dir(self, path: str) -> None:
        self._check("sync_dir", path)
        self.inner.sync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        self._check("rename", src)
        self._check("rename", dst)
        self.inner.rename(src, dst)
        with self._lock:  # space accounting follows the files
            src_key, dst_key = _abs(src), _abs(dst)
            for name in [n for n in self._sizes if n == src_key or n.startswith(src_key + "/")]:
                self._sizes[dst_key + name[len(src_key):]] = self._sizes.pop(name)

    def remove(self, path: str) -> None:
        self._check("remove", path)
        self.inner.remove(path)
        self._freed(path)

    def remove_tree(self, path: str) -> None:
        self._check("remove_tree", path)
        self.inner.remove_tree(path)
        self._freed(path)

    def lock(self, path: str, *, holder: str):
        self._check("lock", path)
        return self.inner.lock(path, holder=holder)


class FaultyReader:
    def __init__(self, storage: FaultyStorage, path: str, inner):
        self.storage, self.path, self.inner = storage, path, inner
        self.size = inner.size

    def read_into(self, buffer: memoryview, offset: int) -> int:
        self.storage._check("read", self.path)
        return self.inner.read_into(buffer, offset)

    def close(self) -> None:
        self.inner.close()


class FaultyWriter:
    def __init__(self, storage: FaultyStorage, path: str, inner):
        self.storage, self.path, self.inner = storage, path, inner

    def write(self, data) -> None:
        self.storage._check("write", self.path)
        view = memoryview(data).cast("B")
        granted = self.storage._take(self.path, len(view))
        if granted:
            self.inner.write(view[:granted])
        if granted < len(view):
            self.storage._short(self.path)

    def close(self) -> int:
        self.storage._check("close", self.path)
        return self.inner.close()

    def abort(self) -> None:
        if self.storage.vanished and self.storage.covers(self.path):
            fd = getattr(self.inner, "fd", -1)  # close it, but the file stays where the mount went
            if isinstance(fd, int) and fd >= 0:
                os.close(fd)
                self.inner.fd = -1
            self.storage._check("abort", self.path)
        self.inner.abort()
        self.storage._freed(self.path)


class PrefixRouter(Storage):
    """The engine's local storage, with paths under each faulty root sent to its FaultyStorage."""

    def __init__(self, default: Storage, faulty: list[FaultyStorage]):
        self.default, self.faulty = default, list(faulty)
        self.scheme, self.is_local, self.atomic_rename = default.scheme, default.is_local, default.atomic_rename

    def pick(self, path: str) -> Storage:
        for storage in self.faulty:
            if storage.covers(path):
                return storage
        return self.default

    def display(self, path): return self.pick(path).display(path)
    def join(self, path, name): return self.pick(path).join(path, name)
    def identity(self, path): return self.pick(path).identity(path)
    def list(self, path): return self.pick(path).list(path)
    def is_dir(self, path): return self.pick(path).is_dir(path)
    def is_file(self, path): return self.pick(path).is_file(path)
    def is_link(self, path): return self.pick(path).is_link(path)
    def exists(self, path): return self.pick(path).exists(path)
    def open_read(self, directory, name): return self.pick(directory).open_read(directory, name)
    def read_bytes(self, directory, name, limit): return self.pick(directory).read_bytes(directory, name, limit)
    def makedirs(self, path): return self.pick(path).makedirs(path)
    def create(self, path): return self.pick(path).create(path)
    def write_bytes(self, path, data): return self.pick(path).write_bytes(path, data)
    def sync_dir(self, path): return self.pick(path).sync_dir(path)
    def rename(self, src, dst): return self.pick(src).rename(src, dst)
    def remove(self, path): return self.pick(path).remove(path)
    def remove_tree(self, path): return self.pick(path).remove_tree(path)
    def lock(self, path, *, holder): return self.pick(path).lock(path, holder=holder)


def install_faulty(monkeypatch, *roots: str | os.PathLike) -> FaultyStorage | list[FaultyStorage]:
    """Route local paths under each of ``roots`` through a new FaultyStorage (one per root, returned
    in order; a single one for a single root) until ``monkeypatch`` is undone."""
    current = ckpt.storage.locate("/").storage  # the local storage, or the router of an earlier install
    default = current.default if isinstance(current, PrefixRouter) else current
    faulty = [FaultyStorage(default, root) for root in roots]
    existing = current.faulty if isinstance(current, PrefixRouter) else []
    router = PrefixRouter(default, [*existing, *faulty])
    monkeypatch.setitem(ckpt.storage.wrappers, "file", lambda local: router)  # one router: the same object
    for storage, root in zip(faulty, roots):  # the engine's own resolution reaches the wrapper
        assert ckpt.storage.locate(os.path.join(os.fspath(root), "x")).storage.pick(
            os.path.join(_abs(root), "x")) is storage
    return faulty[0] if len(faulty) == 1 else faulty

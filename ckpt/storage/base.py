"""The storage seam's interface: what the engine asks of a mount, and :class:`Location`.

Paths are strings in the mount's own syntax with ``/`` separators: a file system path for the local
mount, ``bucket/prefix/...`` for an fsspec one. The engine composes them only through
:class:`Location` (``location / "manifest.json"``), so no module outside :mod:`ckpt.storage` calls
``os`` or ``open`` on checkpoint files.

Durability is the storage's business: :meth:`WriteHandle.close` returns only when the file's bytes
are as durable as the mount makes them (fsync on POSIX; the upload completed and its size checked
on an object store) and :meth:`Storage.write_bytes` likewise. Whether a directory can be renamed
atomically (:attr:`Storage.atomic_rename`) decides the commit protocol (:mod:`ckpt.commit`).
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import Protocol

from ..redact import redact


class ReadHandle(Protocol):
    """One file opened for positional reads."""

    size: int

    def read_into(self, buffer: memoryview, offset: int) -> int:
        """Fill ``buffer`` from ``offset``; the bytes read (fewer only at the end of the file)."""

    def close(self) -> None: ...


def read_scatter(handle: ReadHandle, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in order from the contiguous bytes at ``offset`` (a scatter read: the bytes go
    straight where they belong, as with ``preadv``, on handles that offer ``read_into_views``; others
    read into one buffer and copy out). Returns the bytes read (fewer only at the end of the file)."""
    scatter = getattr(handle, "read_into_views", None)
    if scatter is not None:
        return scatter(views, offset)
    staged = bytearray(sum(len(v) for v in views))
    got = handle.read_into(memoryview(staged), offset)
    at = 0
    for view in views:
        take = min(len(view), got - at)
        if take <= 0:
            break
        view[:take] = staged[at: at + take]
        at += take
    return got


class WriteHandle(Protocol):
    """One new file being written sequentially."""

    def write(self, data) -> None: ...

    def close(self) -> int:
        """Finish the file durably and check it: returns its size."""

    def abort(self) -> None:
        """Give up the file: nothing of it stays visible (safe after a failed write)."""


class Storage:
    """A mount: the file operations the engine uses (see the module docstring)."""

    scheme = "file"
    is_local = True
    atomic_rename = True  # directories can be renamed atomically (the POSIX commit protocol)

    def display(self, path: str) -> str:
        """The path as a URL fit for messages and manifests (never credentials)."""
        raise NotImplementedError

    def join(self, path: str, name: str) -> str:
        return posixpath.join(path, name) if path else name

    # listing
    def list(self, path: str) -> list[str]: raise NotImplementedError
    def is_dir(self, path: str) -> bool: raise NotImplementedError
    def is_file(self, path: str) -> bool: raise NotImplementedError
    def is_link(self, path: str) -> bool: return False
    def exists(self, path: str) -> bool: return self.is_file(path) or self.is_dir(path)
    def identity(self, path: str) -> str: return path  # equal for two paths naming the same entry

    def directory_id(self, path: str):
        """Something that changes when ``path`` becomes another directory (a file system unmounted
        under it, the directory deleted and re-created); None where the mount cannot tell."""
        return None

    # reading: ``name`` ("a" or "a/b") is looked up below ``directory`` and may not leave it
    def open_read(self, directory: str, name: str) -> ReadHandle: raise NotImplementedError

    def read_bytes(self, directory: str, name: str, limit: int) -> bytes:
        """The whole file, refused (ValueError) when larger than ``limit``."""
        handle = self.open_read(directory, name)
        try:
            if handle.size > limit:
                raise ValueError(f"{name} holds {handle.size} bytes, more than {limit}")
            buffer = bytearray(handle.size)
            got = handle.read_into(memoryview(buffer), 0)
            return bytes(buffer[:got])
        finally:
            handle.close()

    # writing
    def makedirs(self, path: str) -> None: raise NotImplementedError
    def create(self, path: str) -> WriteHandle: raise NotImplementedError
    def write_bytes(self, path: str, data: bytes) -> None: raise NotImplementedError
    def sync_dir(self, path: str) -> None: pass
    def rename(self, src: str, dst: str) -> None: raise NotImplementedError

    # deleting (a missing path is not an error)
    def remove(self, path: str) -> None: raise NotImplementedError
    def remove_tree(self, path: str) -> None: raise NotImplementedError

    def never_writable(self, path: str) -> str | None:
        """Why nothing can ever be written at ``path`` (a regular file in the way, a directory this
        process may not write), or None when it can or the mount cannot tell now (it may be down)."""
        return None

    # conditional writes, an ETag compare-and-swap on one small object (what a lease is built on)
    def conditional_writes(self, directory: str) -> bool:
        """Whether :meth:`write_if` is enforced by this mount (objects under ``directory``)."""
        return False

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str] | None:
        """The object's bytes and its entity tag (ETag) in one read; None when it is missing."""
        raise NotImplementedError

    def write_if(self, path: str, data: bytes, *, etag: str | None) -> str | None:
        """Write ``data`` only while the object is still the version ``etag`` (None: only while it
        does not exist); the new tag, or None when the condition failed (another writer's changed it)."""
        raise NotImplementedError

    def conditional_deletes(self, directory: str) -> bool:
        """Whether :meth:`delete_if` is enforced by this mount (objects under ``directory``)."""
        return False

    def delete_if(self, path: str, etag: str) -> bool:
        """Delete the object only while it is still the version ``etag``; False when it is not."""
        raise NotImplementedError

    # the root's writer lock
    def lock(self, path: str, *, holder: str):
        """Take the exclusive writer lock at ``path``; returns an object with ``release()``.
        Raises CheckpointLockedError naming the holder when another writer has it."""
        raise NotImplementedError


@dataclass(frozen=True)
class Location:
    """A path on a mount: ``Location(storage, path)``; compose with ``/``."""

    storage: Storage
    path: str

    def __truediv__(self, name: str) -> "Location":
        return Location(self.storage, self.storage.join(self.path, name))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def parent(self) -> "Location":
        return Location(self.storage, posixpath.dirname(self.path.rstrip("/")) or ".")

    @property
    def is_local(self) -> bool:
        return self.storage.is_local

    @property
    def display_name(self) -> str:
        """The name of the mount (or step) this location is, the one the catalog, ``ckpt inspect``
        and a run's claim use: an absolute path when local, else its URL (``s3://bucket/run``);
        never credentials, no trailing ``/``."""
        if self.is_local:
            return os.path.abspath(self.path)
        return redact(str(self)).rstrip("/")

    def __str__(self) -> str:
        return self.storage.display(self.path)

    def __fspath__(self) -> str:
        """A local location is an ``os.PathLike`` (``open``, ``shutil`` and ``pathlib`` take it)."""
        if not self.storage.is_local:
            raise TypeError(f"{self} is not on a local file system")
        return self.path

    def __repr__(self) -> str:
        return f"Location({str(self)!r})"

    def list(self) -> list[str]:
        return self.storage.list(self.path)

    def is_dir(self) -> bool:
        return self.storage.is_dir(self.path)

    def is_file(self) -> bool:
        return self.storage.is_file(self.path)

    def exists(self) -> bool:
        return self.storage.exists(self.path)

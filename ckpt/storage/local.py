"""The local POSIX mount: local disks, NFS, Lustre and any file system with atomic rename.

The fast path of the engine: data files are written with plain ``write`` calls of up to 64 MiB,
the kernel is told to start writeback as they grow (``sync_file_range``), and each file is fsync'd
before it counts as written. Reads are positional (``preadv`` straight into the caller's buffer)
and open names below a checkpoint directory without following a symbolic link on the way.
The root's lock is an ``flock`` on ``.lock``, which records the holder's host and pid.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import stat

from ..errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidManifestError,
    StorageError,
)
from .base import Storage
from ._posix_io import Writeback, fsync_dir, pread_into, preadv_into, write_all, write_file_durably


class LocalStorage(Storage):
    scheme = "file"
    is_local = True
    atomic_rename = True

    def display(self, path: str) -> str:
        return path

    def list(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:  # EIO, ENOTCONN, ESTALE, EACCES: the mount, not the checkpoint
            raise _unreachable(path, "listing", exc) from None

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def identity(self, path: str) -> str:
        return os.path.realpath(path)

    def directory_id(self, path: str):
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        return (info.st_dev, info.st_ino)

    def open_read(self, directory: str, name: str) -> "LocalReader":
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):  # gone since its manifest was read (retention)
            raise CheckpointNotFoundError(f"{directory} is gone", path=directory, file=name) from None
        except OSError as exc:
            raise _unreachable(directory, "opening", exc) from None
        try:
            return LocalReader(open_beneath(dir_fd, name, where=directory))
        finally:
            os.close(dir_fd)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def create(self, path: str) -> "LocalWriter":
        return LocalWriter(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        write_file_durably(path, data)

    def sync_dir(self, path: str) -> None:
        fsync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            self.remove(path)

    def never_writable(self, path: str) -> str | None:
        probe = os.path.abspath(path)
        while True:
            try:
                info = os.stat(probe)
            except FileNotFoundError:
                parent = os.path.dirname(probe)
                if parent == probe:
                    return None
                probe = parent
                continue
            except NotADirectoryError:
                probe = os.path.dirname(probe)
                continue
            except OSError:  # a dead mount: it may come back
                return None
            if not stat.S_ISDIR(info.st_mode):
                return f"{probe} is not a directory"
            if not os.access(probe, os.W_OK | os.X_OK):
                return f"{probe} is not writable by this process"
            return None

    def lock(self, path: str, *, holder: str) -> "LocalLock":
        return LocalLock(path, holder)


def _unreachable(path: str, what: str, exc: OSError) -> StorageError:
    return StorageError(f"{what} {path} failed: {os.strerror(exc.errno) if exc.errno else exc}", path=path)


class LocalReader:
    def __init__(self, fd: int):
        self.fd, self.size = fd, os.fstat(fd).st_size

    def read_into(self, buffer: memoryview, offset: int) -> int:
        return pread_into(self.fd, buffer, offset)

    def read_into_views(self, views: list[memoryview], offset: int) -> int:
        return preadv_into(self.fd, views, offset)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalWriter:
    """A new file (created exclusively), written with writeback started as it grows; ``close``
    fsyncs it."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.writeback = Writeback(self.fd)
        self.size = 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        write_all(self.fd, view)
        self.size += len(view)
        self.writeback.advance(self.size)

    def close(self) -> int:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1
        return self.size

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LocalLock:
    """``flock`` on ``path``; the file says who holds it (``host pid``) for the refusal message."""

    def __init__(self, path: str, holder: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                current = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
            finally:
                os.close(fd)
            raise CheckpointLockedError(f"another CheckpointManager is writing to {os.path.dirname(path)} "
                                        f"(lock held by {current})", path=os.path.dirname(path)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def holder_text() -> str:
    return f"host {socket.gethostname()} pid {os.getpid()}"


def open_beneath(dir_fd: int, name: str, *, where: str) -> int:
    """Open the regular file ``name`` ("a" or "a/b") below the directory ``dir_fd`` for reading,
    following no symbolic link on the way (a link swapped in between checks cannot escape)."""
    parts = name.split("/")
    opened: list[int] = []
    try:
        parent = dir_fd
        for part in parts[:-1]:
            parent = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            opened.append(parent)
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: {name} is missing", path=where, file=name) from None
    except OSError as exc:  # ELOOP (a link), ENOTDIR: the name leads out of plain files and folders
        raise InvalidManifestError(f"{where}: {name} is not a plain file inside the checkpoint "
                                   f"({os.strerror(exc.errno)}); refused", path=where, file=name) from None
    finally:
        for fd_ in opened:
            os.close(fd_)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidManifestError(f"{where}: {name} is not a regular file; refused", path=where, file=name)
    return fd

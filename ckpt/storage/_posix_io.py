"""POSIX I/O helpers of the local mount: full writes, positional reads into caller buffers, durable files
and directories."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# One syscall moves at most this much; Linux caps a single read/write near 2 GiB anyway.
IO_SLICE = 64 << 20


def write_all(fd: int, buffer: memoryview) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done : done + IO_SLICE])


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class Writeback:
    """Starts the kernel writing dirty pages every ``every`` bytes instead of all at the final fsync,
    so the disk works while later payloads are still being copied (Linux ``sync_file_range``; a
    no-op elsewhere). The final fsync stays: this only moves the work earlier."""

    def __init__(self, fd: int, every: int = IO_SLICE):
        self.fd, self.every, self.flushed = fd, every, 0

    def advance(self, end: int) -> None:
        if _sync_file_range is None or end - self.flushed < self.every:
            return
        _sync_file_range(self.fd, self.flushed, end - self.flushed, _SYNC_FILE_RANGE_WRITE)
        self.flushed = end


IOV_MAX = 1024  # buffers per preadv call (Linux's UIO_MAXIOV)


def preadv_into(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in order from ``offset`` (scatter reads of at most ``IOV_MAX`` buffers each);
    returns the bytes read (fewer only at end of file)."""
    done = 0
    index, skip = 0, 0  # the first view not yet full, and how much of it is
    while index < len(views):
        batch = [views[index][skip:]] + views[index + 1: index + IOV_MAX]
        n = os.preadv(fd, batch, offset + done)
        if n == 0:
            break
        done += n
        if n == sum(map(len, batch)):  # the usual case: every buffer of the batch filled
            index, skip = index + len(batch), 0
            continue
        n += skip
        while index < len(views) and n >= len(views[index]):
            n -= len(views[index])
            index += 1
        skip = n
    return done


def pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Fill ``buffer`` from ``offset``; returns the bytes read (fewer only at end of file)."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + IO_SLICE]], offset + done)
        if n == 0:
            break
        done += n
    return done


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)

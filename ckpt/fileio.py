"""Small POSIX I/O helpers: full writes, positional reads into caller buffers, durable directories."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

# One syscall moves at most this much; Linux caps a single read/write near 2 GiB anyway.
IO_SLICE = 64 << 20
ALIGN = 4096
# Chunks at least this big start on a 4 KiB boundary so mmap/O_DIRECT readers can serve them
# alone; smaller ones are packed to avoid wasting a page per norm weight.
ALIGN_MIN_BYTES = 64 << 10


def checksum(buffer) -> str:
    """xxh3-64 of a bytes-like object as 16 hex digits (releases the GIL on large inputs)."""
    return f"{xxhash.xxh3_64_intdigest(buffer):016x}"


def aligned(offset: int, length: int) -> int:
    """Where a chunk of ``length`` bytes written at or after ``offset`` should start."""
    if length < ALIGN_MIN_BYTES:
        return offset
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def write_all(fd: int, buffer: memoryview) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done : done + IO_SLICE])


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, memoryview(data))
        os.fsync(fd)
    finally:
        os.close(fd)

"""The catalog's files on disk, checked before LMDB opens them (issue 22, items 10 and 11).

LMDB follows whatever it is given: a ``.catalog`` that is a symlink (or a ``data.mdb``/``lock.mdb``
that is one, or a hard link to another file) makes a rebuild wipe and rewrite a database outside the
root; a ``data.mdb`` cut below its last used page makes the first read of a page past the end of the
file kill the process (SIGBUS in the memory map). So, before every open, :func:`check_files`
requires:

* the catalog path a real directory (``lstat``: not a symlink), or absent;
* ``data.mdb`` and ``lock.mdb`` regular files (not symlinks, one link each), or absent;
* ``data.mdb``, unless empty (LMDB initialises an empty file), holding its two meta pages (magic
  ``0xBEEFC0DE``, data version 1, the meta page flag) and at least as many bytes as the pages they
  say are in use: ``(last page + 1) * page size`` for either meta. LMDB never reads a page at or
  past that number (it answers ``MDB_PAGE_NOTFOUND``), so with this size every page it may read is
  in the file.

:func:`open_env` checks, then opens the environment (read-only media: without LMDB's lock file).
Anything else is :class:`~ckpt.errors.CorruptCheckpointError`: the caller discards and rebuilds
(:func:`discard`, which removes a symlink itself, never what it points to) or ignores the catalog.
The files are read with ``O_NOFOLLOW``. Layout (LMDB 0.9, 64-bit): a page header of 16 bytes (page
number 8, pad 2, flags 2, lower/upper 4), then ``MDB_meta``: magic 4, version 4, address 8, map
size 8, two ``MDB_db`` of 48 bytes (the first's leading 4 bytes hold the page size), last page 8,
transaction id 8.
"""

from __future__ import annotations

import os
import stat
import struct

import lmdb

from ...errors import CheckpointError, CorruptCheckpointError

LMDB_FILES = ("data.mdb", "lock.mdb")
MAGIC, DATA_VERSION, P_META = 0xBEEFC0DE, 1, 0x08
_HEADER = 16
_MAGIC_AT, _PSIZE_AT, _LAST_PAGE_AT = _HEADER, _HEADER + 24, _HEADER + 120
_META_END = _LAST_PAGE_AT + 16


def _damaged(path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"catalog {path}: {why}", path=path)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot examine the catalog path {path}: {exc}", path=path) from None


def _read_at(fd: int, offset: int, size: int) -> bytes:
    return os.pread(fd, size, offset)


def _meta(path: str, raw: bytes, which: int) -> tuple[int, int]:
    """``(page size, last page)`` of one meta page (``raw`` starts at that page)."""
    if len(raw) < _META_END:
        raise _damaged(path, f"data.mdb is too short for meta page {which}")
    (flags,) = struct.unpack_from("<H", raw, 10)
    magic, version = struct.unpack_from("<II", raw, _MAGIC_AT)
    if magic != MAGIC or version != DATA_VERSION or not flags & P_META:
        raise _damaged(path, f"data.mdb's meta page {which} is not an LMDB meta page")
    (psize,) = struct.unpack_from("<I", raw, _PSIZE_AT)
    (last_page,) = struct.unpack_from("<Q", raw, _LAST_PAGE_AT)
    return psize, last_page


def _check_data(path: str, data: str) -> None:
    try:
        fd = os.open(data, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _damaged(path, f"data.mdb cannot be opened: {exc}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return
        psize, last0 = _meta(path, _read_at(fd, 0, _META_END), 0)
        if psize < 512 or psize > 1 << 16 or psize & (psize - 1):
            raise _damaged(path, f"data.mdb's meta page 0 names a page size of {psize}")
        _psize1, last1 = _meta(path, _read_at(fd, psize, _META_END), 1)
        needed = (max(last0, last1) + 1) * psize
        if size < needed:
            raise _damaged(path, f"data.mdb holds {size} bytes; its meta pages use {needed} (truncated)")
    finally:
        os.close(fd)


def check_files(path: str) -> None:
    """Refuse a catalog directory LMDB must not open (see the module docstring)."""
    found = _lstat(path)
    if found is None:
        return
    if stat.S_ISLNK(found.st_mode):
        raise _damaged(path, "the catalog directory is a symlink (never followed)")
    if not stat.S_ISDIR(found.st_mode):
        raise CheckpointError(f"catalog path {path} is a file, not a directory; remove it or choose another",
                              path=path)
    for name in LMDB_FILES:
        file = _lstat(os.path.join(path, name))
        if file is None:
            continue
        if not stat.S_ISREG(file.st_mode):
            raise _damaged(path, f"{name} is not a regular file (a symlink is never followed)")
        if file.st_nlink != 1:
            raise _damaged(path, f"{name} has {file.st_nlink} hard links (it may be another database's)")
    if _lstat(os.path.join(path, "data.mdb")) is not None:
        _check_data(path, os.path.join(path, "data.mdb"))


MAP_SIZE = 1 << 30  # sparse on Linux: the file grows with the data
DAMAGE = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError,
          lmdb.BadValsizeError)  # the files are damaged (not: busy, missing, no permission)


def open_env(path: str, readonly: bool) -> lmdb.Environment:
    """The LMDB environment of the catalog directory ``path``, its files checked first; raises
    ``lmdb.Error`` or ``OSError`` as LMDB does, :class:`CorruptCheckpointError` from the checks."""
    options = dict(map_size=MAP_SIZE, max_dbs=4, subdir=True, readonly=readonly, lock=True,
                   create=not readonly, max_readers=256)
    check_files(path)  # a real directory of real files, none cut short (never followed)
    if not readonly:
        os.makedirs(path, exist_ok=True)
    try:
        return lmdb.open(path, **options)
    except lmdb.Error as exc:
        if not readonly or isinstance(exc, DAMAGE) or not os.path.isfile(os.path.join(path, "data.mdb")):
            raise
        # lock.mdb cannot be opened (read-only media, no permission): read without the reader
        # table; only safe while no writer is active, which such media implies
        return lmdb.open(path, **dict(options, lock=False))


def discard(path: str) -> None:
    """Remove a damaged catalog's LMDB files (only those: the directory may hold other things); a
    symlink, as the directory or as one of the files, is removed itself, never followed."""
    found = _lstat(path)
    if found is not None and stat.S_ISLNK(found.st_mode):
        try:
            os.unlink(path)
        except OSError as exc:
            raise CheckpointError(f"cannot remove the catalog symlink {path}: {exc}", path=path) from None
        return
    if found is not None and not stat.S_ISDIR(found.st_mode):
        raise CheckpointError(f"catalog path {path} is a file, not a directory; remove it or choose another",
                              path=path)
    for name in LMDB_FILES:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise CheckpointError(f"cannot remove the damaged catalog file {name} in {path}: {exc}",
                                  path=path) from None

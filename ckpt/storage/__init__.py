"""The storage seam: every byte the engine moves to or from a mount goes through a :class:`Storage`.

    location = locate("ckpts/run1")                       # the local POSIX mount (fast path)
    location = locate("s3://bucket/run1", {"client_kwargs": {"endpoint_url": ...}})   # fsspec

A plain path or ``file://`` URL selects :class:`~ckpt.storage.local.LocalStorage`; any other URL
selects :class:`~ckpt.storage.remote.FsspecStorage` over the filesystem fsspec builds for it with
``storage_options`` passed through (for ``s3://``, s3fs also reads the standard AWS environment
variables). The interface and its durability contract are in :mod:`ckpt.storage.base`.
"""

from __future__ import annotations

import os
import threading

from ..errors import StorageError
from .base import Location, ReadHandle, Storage, WriteHandle
from .local import LocalStorage, holder_text

__all__ = ["Location", "Storage", "ReadHandle", "WriteHandle", "LocalStorage", "locate", "is_url", "holder_text"]

_LOCAL = LocalStorage()
_remote: dict[int, Storage] = {}
_remote_lock = threading.Lock()


def is_url(target) -> bool:
    return not isinstance(target, Location) and "://" in os.fspath(target)


def locate(target: str | os.PathLike | Location, storage_options: dict | None = None) -> Location:
    """The mount and path ``target`` names (a Location is returned as it is)."""
    if isinstance(target, Location):
        return target
    text = os.fspath(target)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if "://" not in text:
        return Location(_LOCAL, text.rstrip("/") or "/")
    scheme = text.split("://", 1)[0]
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(text, **(storage_options or {}))
    except ImportError as exc:
        raise StorageError(f"{scheme}:// needs a package that is not installed ({exc.name}); for S3: "
                           f"pip install 'ckpt-engine[s3]'", path=f"{scheme}://") from None
    except (ValueError, TypeError) as exc:
        raise StorageError(f"cannot open {scheme}:// mounts: {exc}", path=f"{scheme}://") from None
    from .remote import FsspecStorage

    with _remote_lock:
        storage = _remote.get(id(fs))
        if storage is None or storage.fs is not fs:
            storage = _remote[id(fs)] = FsspecStorage(fs, scheme)
    return Location(storage, path.rstrip("/"))

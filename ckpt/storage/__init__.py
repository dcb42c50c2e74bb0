"""The storage seam: every byte the engine moves to or from a mount goes through a :class:`Storage`.

    location = locate("ckpts/run1")                       # the local POSIX mount (fast path)
    location = locate("s3://bucket/run1", {"client_kwargs": {"endpoint_url": ...}})   # fsspec

A plain path or ``file://`` URL selects :class:`~ckpt.storage.local.LocalStorage`; any other URL
selects :class:`~ckpt.storage.remote.FsspecStorage` over the filesystem fsspec builds for it with
``storage_options`` passed through (for ``s3://``, s3fs also reads the standard AWS environment
variables). Credentials in an ``s3://KEY:SECRET@bucket/...`` URL are taken out of it and given as the
``key``/``secret`` storage options (percent-decoded), so no location, display or message holds them;
userinfo in another scheme's URL and a query string in any mount URL are refused (:mod:`ckpt.redact`
removes credentials from every text the engine writes or prints). The interface and its durability contract are in :mod:`ckpt.storage.base`.

Resolved once, at the door: a public entry point (``ckpt.save``/``ckpt.load``, the ``Reader``/``Writer``
constructors, ``read_manifest``, the manager, the tools) calls :func:`locate` on the path or URL it was
given and passes the :class:`Location` inward; code inside takes a Location and never locates again
(``ckpt.load`` of a path: one call, tests/ckpt/test_resolve_once.py).

Wrapping a mount (fault injection, tracing, a test's spy) goes through one public seam, never through
this module's internals: :data:`wrappers` maps a scheme (``"file"`` for plain paths and ``file://``
URLs, else the URL's scheme, e.g. ``"s3"``) to a function that takes the storage ``locate()`` chose
and returns the one to use instead; :func:`wrapped` installs one for the length of a ``with`` block::

    with wrapped("file", lambda local: TracingStorage(local)):
        ckpt.save(state, "ckpts/step-1")      # every local file operation goes through the wrapper

The wrapper is called at every ``locate()`` and must return the same object for the same storage
(the engine compares mounts by identity). A :class:`Location` keeps the storage it was made with:
install before the manager, root or load that should see the wrapper. Under pytest,
``monkeypatch.setitem(ckpt.storage.wrappers, scheme, wrapper)`` does the same until teardown.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from urllib.parse import unquote

from ..errors import StorageError
from .base import Location, ReadHandle, Storage, WriteHandle
from .local import LocalStorage, holder_text
from ..redact import redact, split_userinfo

__all__ = ["Location", "Storage", "ReadHandle", "WriteHandle", "LocalStorage", "locate", "is_url", "holder_text",
           "wrappers", "wrapped", "PART_BYTES", "PARALLEL_PARTS", "RANGE_BYTES"]

_OBJECT_STORE_TUNING = ("PART_BYTES", "PARALLEL_PARTS", "RANGE_BYTES")  # ckpt.storage.remote's, imported when asked


def __getattr__(name: str):
    if name in _OBJECT_STORE_TUNING:  # fsspec is imported only by a caller that uses an object store
        from . import remote
        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_LOCAL = LocalStorage()
_USERINFO_OPTIONS = {"s3": ("key", "secret"), "s3a": ("key", "secret")}  # scheme -> fsspec's option names
wrappers: dict[str, Callable[[Storage], Storage]] = {}
"""scheme -> the wrapper ``locate()`` applies to that scheme's storage (see the module docstring)."""
_remote: dict[int, Storage] = {}
_remote_lock = threading.Lock()


def is_url(target) -> bool:
    """Whether ``target`` names a mount by URL (``s3://bucket/run``; fsspec's storage), not a local
    path or a :class:`Location`: the one test for it (the trainer, the tools and the plug-ins ask here)."""
    return not isinstance(target, Location) and "://" in os.fspath(target)


@contextlib.contextmanager
def wrapped(scheme: str, wrapper: Callable[[Storage], Storage]) -> Iterator[None]:
    """``locate()`` answers ``scheme``'s paths through ``wrapper`` inside the block; the wrapper
    installed before (or none) is back afterwards."""
    missing = object()
    previous = wrappers.get(scheme, missing)
    wrappers[scheme] = wrapper
    try:
        yield
    finally:
        if previous is missing:
            wrappers.pop(scheme, None)
        else:
            wrappers[scheme] = previous


def _wrap(scheme: str, storage: Storage) -> Storage:
    wrapper = wrappers.get(scheme)
    return storage if wrapper is None else wrapper(storage)


def locate(target: str | os.PathLike | Location, storage_options: dict | None = None) -> Location:
    """The mount and path ``target`` names (a Location is returned as it is)."""
    if isinstance(target, Location):
        return target
    text = os.fspath(target)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if "://" not in text:
        return Location(_wrap("file", _LOCAL), text.rstrip("/") or "/")
    scheme = text.split("://", 1)[0]
    if "?" in text:
        raise StorageError(f"the mount URL {redact(text)} has a query string: a mount is named by a plain URL "
                           "(its text would become part of every object's name); give credentials in the "
                           "environment or storage_options", path=redact(text))
    text, key, secret = split_userinfo(text)
    if key is not None and scheme in _USERINFO_OPTIONS:  # s3://KEY:SECRET@bucket: the mount's credentials
        names = _USERINFO_OPTIONS[scheme]
        storage_options = {**(storage_options or {}), names[0]: unquote(key),
                           **({} if secret is None else {names[1]: unquote(secret)})}
    elif key is not None:
        raise StorageError(f"{scheme}:// mounts take no credentials in the URL ({redact(text)}); give them in "
                           "the environment or storage_options", path=text)
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
    return Location(_wrap(scheme, storage), path.rstrip("/"))

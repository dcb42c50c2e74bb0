"""Bytes read, counted: :func:`counted` gives a location whose opened files count every byte
their positional reads return into one :class:`ReadCounter` (the load's ``bytes_read``).

The wrapper delegates everything else to the storage it wraps, one wrapper per storage object (so
locations that named the same mount still compare equal: a delta's base, a mirror)."""

from __future__ import annotations

import threading

from .base import Location, ReadHandle, read_scatter


class ReadCounter:
    """A byte count shared by the files opened through :func:`counted` (thread-safe)."""

    def __init__(self):
        self.bytes = 0
        self._lock = threading.Lock()
        self._wrappers: dict[int, _CountingStorage] = {}

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n

    def wrap(self, storage) -> "_CountingStorage":
        if isinstance(storage, _CountingStorage):
            return storage
        if id(storage) not in self._wrappers:
            self._wrappers[id(storage)] = _CountingStorage(storage, self)
        return self._wrappers[id(storage)]


def counted(location: Location, counter: ReadCounter) -> Location:
    """``location`` with its reads counted into ``counter``."""
    return Location(counter.wrap(location.storage), location.path)


class _CountingStorage:
    def __init__(self, inner, counter: ReadCounter):
        self.inner, self.counter = inner, counter

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_read(self, directory: str, name: str) -> ReadHandle:
        return _CountingHandle(self.inner.open_read(directory, name), self.counter)


class _CountingHandle:
    def __init__(self, inner: ReadHandle, counter: ReadCounter):
        self.inner, self.counter = inner, counter
        self.size = inner.size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_into(self, buffer: memoryview, offset: int) -> int:
        n = self.inner.read_into(buffer, offset)
        self.counter.add(n)
        return n

    def read_into_views(self, views: list[memoryview], offset: int) -> int:
        n = read_scatter(self.inner, views, offset)
        self.counter.add(n)
        return n

    def close(self) -> None:
        self.inner.close()

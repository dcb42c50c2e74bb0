"""Bytes read from storage, counted at the storage layer: for a load's "read once" checks.

    with counting_reads() as reads:          # every local file opened for reading in the block
        ckpt.load(state, path)
    reads.data_bytes()                       # bytes returned by positional reads of the data files (*.bin)
    reads.order                              # every read in the order it was made: (file, offset, bytes)

Installed through the engine's public seam (``ckpt.storage.wrapped("file", ...)``), independent of
the engine's own counter (``LoadStats.bytes_read``), so a test can check one against the other.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator

import ckpt.storage


class Reads:
    def __init__(self):
        self.by_file: Counter = Counter()
        self.order: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        self._wrappers: dict[int, _Storage] = {}

    def add(self, name: str, n: int, offset: int) -> None:
        with self._lock:
            self.by_file[name] += n
            self.order.append((name, offset, n))

    def data_bytes(self) -> int:
        return sum(n for name, n in self.by_file.items() if name.endswith(".bin"))

    def wrap(self, storage):
        if id(storage) not in self._wrappers:
            self._wrappers[id(storage)] = _Storage(storage, self)
        return self._wrappers[id(storage)]


class _Storage:
    def __init__(self, inner, reads: Reads):
        self.inner, self.reads = inner, reads

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_read(self, directory, name):
        return _Handle(self.inner.open_read(directory, name), self.reads, name)


class _Handle:
    def __init__(self, inner, reads: Reads, name: str):
        self.inner, self.reads, self.name, self.size = inner, reads, name, inner.size

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_into(self, buffer, offset):
        n = self.inner.read_into(buffer, offset)
        self.reads.add(self.name, n, offset)
        return n

    def read_into_views(self, views, offset):  # scatter reads (ckpt.storage.base.read_scatter)
        n = self.inner.read_into_views(views, offset)
        self.reads.add(self.name, n, offset)
        return n

    def close(self):
        self.inner.close()


@contextlib.contextmanager
def counting_reads() -> Iterator[Reads]:
    reads = Reads()
    with ckpt.storage.wrapped("file", reads.wrap):
        yield reads

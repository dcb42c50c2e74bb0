"""Outputs that are not checkpoints, published whole: one file (:class:`PendingFile`) or a directory
of files (:class:`PendingDirectory`), each through its mount's commit strategy.

    with PendingFile(dst, overwrite=False) as out:         # dst appears when the block ends
        out.write(header); out.write(payload)

    with PendingDirectory(dst, overwrite=True) as out:     # a sharded export
        shard = out.create("model-00001-of-00002.safetensors")   # a WriteHandle: write(), close()
        ...
        out.write_bytes("model.safetensors.index.json", index)  # the file that makes it usable: last

Leaving the block normally publishes, an error aborts (nothing of the attempt stays); ``publish()``
and ``abort()`` may be called instead. On POSIX both are written under ``<name>.tmp-<id>`` beside the
target, fsync'd and renamed over it (an existing directory is moved aside first, deleted after); the
next write of the same target removes what a dead one left. On an object store a file is one upload
that appears whole when it completes; a directory's files are written in place, so write its index
last; an overwrite removes the old output's files that were not rewritten. Write a directory's files
through :meth:`PendingDirectory.create` / :meth:`PendingDirectory.write_bytes`: the names written are
what an object-store overwrite keeps. The target is a :class:`~ckpt.storage.Location` (resolved by the caller).
"""

from __future__ import annotations

from ..storage import Location, WriteHandle
from .protocol import strategy_for


class _Pending:
    """A ``with`` block around an output: leaving it normally publishes, an error aborts."""

    def publish(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.publish()
        except BaseException:
            self.abort()
            raise


class PendingFile(_Pending):
    """A single file being written, published whole by :meth:`publish` or removed by :meth:`abort`."""

    def __init__(self, target: Location, *, overwrite: bool):
        self.target = target
        self.overwrite = overwrite
        self._strategy = strategy_for(target.storage)
        self.tmp = self._strategy.begin_file(target, overwrite=overwrite)
        self._handle = target.storage.create(self.tmp.path)

    def write(self, data) -> None:
        self._handle.write(data)

    def publish(self) -> None:
        self._handle.close()
        self._strategy.publish_file(self.tmp, self.target, overwrite=self.overwrite)

    def abort(self) -> None:
        self._handle.abort()


class PendingDirectory(_Pending):
    """A directory of files being written, published whole by :meth:`publish` or removed by
    :meth:`abort` (see the module docstring). ``directory``: where its files are (for reading back)."""

    def __init__(self, target: Location, *, overwrite: bool):
        self.target = target
        self._strategy = strategy_for(target.storage)
        self._attempt = self._strategy.begin_directory(target, overwrite=overwrite)
        self.directory = self._attempt.directory
        self.written: set[str] = set()
        self._done = False

    def create(self, name: str) -> WriteHandle:
        """A new file ``name`` in the directory (``close()`` it to finish it, ``abort()`` to drop it)."""
        self.written.add(name)
        return self.directory.storage.create((self.directory / name).path)

    def write_bytes(self, name: str, data: bytes) -> None:
        self.written.add(name)
        self.directory.storage.write_bytes((self.directory / name).path, data)

    def publish(self) -> None:
        self._strategy.publish_directory(self._attempt, set(self.written))
        self._done = True

    def abort(self) -> None:
        """Remove what this attempt wrote (safe to call twice; nothing once published)."""
        if not self._done:
            self._strategy.abort_directory(self._attempt, set(self.written))
            self._done = True

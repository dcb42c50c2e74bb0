"""Crash states of a recorded operation sequence (:mod:`tests.support.recording`), exhaustive over the
operation boundaries, in the manner of ALICE and CrashMonkey.

    model = PosixModel.of(root)              # the durable tree before the recording (all of it durable)
    for op in rec.ops: ...                   # model.apply(op) after each boundary
    model.crash_states()                     # every state a crash at this boundary can leave

:class:`PosixModel` is a file system with a page cache, at inode level: a file's bytes become durable
at an ``fsync`` of the file, a directory's entries (creations, renames, removals in it) at an
``fsync_dir`` of the directory. At a crash, every file whose bytes are not durable and every directory
whose entries are not durable may independently have reached the disk or not: :meth:`crash_states`
enumerates every combination (2^n for n pending items; a file that never reached the disk reads as
empty). So a write not followed by an fsync of the file *and* of its directory can be lost, and a
rename not followed by an fsync of its directory may be lost — or may not.

:class:`ObjectModel` is an object store: a ``put`` (``write_bytes``, or the ``close`` that completes
an upload) is visible whole once it returned, a delete once it returned; nothing is cached, so a
crash after operation k leaves exactly the first k operations. A recursive delete is expanded into one
delete per object, manifests last (the worst order for a reader).

:func:`materialize` writes a state into a directory; :class:`LocalObjectStore` is a local storage that
takes the object-store commit strategy, to read an object-store state back without a server.
"""

from __future__ import annotations

import itertools
import os
import posixpath
from pathlib import Path

from ckpt.storage import LocalStorage

State = tuple[tuple[str, bytes], ...]  # sorted (relative path, bytes); directories end in "/"
MAX_PENDING = 10  # 2^10 combinations per boundary at most; more is refused (a test scenario too big)


class _File:
    def __init__(self, data: bytes = b"", durable: bytes | None = None):
        self.data, self.durable = data, durable

    def pending(self) -> bool:
        return self.data != (self.durable or b"")


class _Dir:
    def __init__(self, durable: bool = False):
        self.entries: dict[str, object] = {}
        self.durable: dict[str, object] = {}

    def pending(self) -> bool:
        return self.entries.keys() != self.durable.keys() or any(
            self.durable[name] is not inode for name, inode in self.entries.items())


class PosixModel:
    """A POSIX file system with a page cache (see the module docstring)."""

    def __init__(self):
        self.root = _Dir()
        self.inodes: list[object] = [self.root]

    @classmethod
    def of(cls, path: str | os.PathLike) -> "PosixModel":
        """The tree under ``path`` as it is now, all of it durable (``.lock``, ``.catalog`` left out)."""
        model = cls()
        base = Path(path)
        for current, dirs, files in os.walk(base):
            rel = os.path.relpath(current, base)
            node = model._lookup(rel)
            dirs[:] = [d for d in sorted(dirs) if d != ".catalog"]
            for name in dirs:
                node.entries[name] = node.durable[name] = child = _Dir()
                model.inodes.append(child)
            for name in sorted(files):
                if name == ".lock":
                    continue
                data = (Path(current) / name).read_bytes()
                node.entries[name] = node.durable[name] = child = _File(data, data)
                model.inodes.append(child)
        return model

    def _lookup(self, rel: str):
        node = self.root
        for part in [p for p in rel.split("/") if p not in ("", ".")]:
            node = node.entries[part]
        return node

    def _parent(self, rel: str) -> tuple[_Dir, str]:
        return self._lookup(posixpath.dirname(rel)), posixpath.basename(rel)

    def apply(self, op) -> None:
        kind, path = op.kind, op.path
        if kind == "makedirs":
            node = self.root
            for part in [p for p in path.split("/") if p not in ("", ".")]:
                if part not in node.entries:
                    node.entries[part] = child = _Dir()
                    self.inodes.append(child)
                node = node.entries[part]
        elif kind == "create":
            parent, name = self._parent(path)
            parent.entries[name] = child = _File()
            self.inodes.append(child)
        elif kind == "write":
            self._lookup(path).data += op.data
        elif kind == "write_bytes":  # O_CREAT | O_TRUNC: the same inode when it exists
            parent, name = self._parent(path)
            if name in parent.entries:
                parent.entries[name].data = op.data
            else:
                parent.entries[name] = child = _File(op.data)
                self.inodes.append(child)
        elif kind == "fsync":
            node = self._lookup(path)
            node.durable = node.data
        elif kind == "fsync_dir":
            node = self._lookup(path)
            node.durable = dict(node.entries)
        elif kind == "rename":
            src_parent, src = self._parent(path)
            dst_parent, dst = self._parent(op.dst)
            dst_parent.entries[dst] = src_parent.entries.pop(src)
        elif kind in ("remove", "abort"):
            parent, name = self._parent(path)
            parent.entries.pop(name, None)
        elif kind == "remove_tree":
            parent, name = self._parent(path)
            gone = parent.entries.pop(name, None)
            stack = [gone]
            while stack:  # rmtree unlinks everything below too (durable only where a directory is synced)
                node = stack.pop()
                if isinstance(node, _Dir):
                    stack.extend(node.entries.values())
                    node.entries = {}
        # list, close, sync_dir (its fsync_dir is recorded itself): no change

    def pending(self) -> list[object]:
        return [inode for inode in self.inodes if inode.pending()]

    def crash_states(self) -> list[State]:
        """Every state a crash now can leave (see the module docstring)."""
        pending = self.pending()
        if len(pending) > MAX_PENDING:
            raise AssertionError(f"{len(pending)} items not durable at once: too many to enumerate; "
                                 "a smaller scenario, or an fsync missing")
        states = set()
        for flags in itertools.product((False, True), repeat=len(pending)):
            reached = {id(inode) for inode, flag in zip(pending, flags) if flag}
            states.add(self._state(reached))
        return sorted(states)

    def final_state(self) -> State:
        """What a clean shutdown leaves (everything reached the disk)."""
        return self._state({id(inode) for inode in self.inodes})

    def _state(self, reached: set[int]) -> State:
        out: list[tuple[str, bytes]] = []

        def walk(node: _Dir, prefix: str, depth: int) -> None:
            entries = node.entries if id(node) in reached else node.durable
            for name, child in sorted(entries.items()):
                rel = f"{prefix}{name}"
                if isinstance(child, _Dir):
                    out.append((rel + "/", b""))
                    if depth < 32:
                        walk(child, rel + "/", depth + 1)
                else:
                    out.append((rel, child.data if id(child) in reached else (child.durable or b"")))

        walk(self.root, "", 0)
        return tuple(out)


class ObjectModel:
    """An object store (see the module docstring)."""

    def __init__(self, objects: dict[str, bytes] | None = None):
        self.objects = dict(objects or {})
        self.uploads: dict[str, bytearray] = {}

    @classmethod
    def of(cls, fs, prefix: str) -> "ObjectModel":
        """The objects under ``prefix`` of the fsspec filesystem ``fs`` (``.lock`` left out)."""
        objects = {}
        for path in fs.find(prefix):
            rel = path[len(prefix.rstrip("/")) + 1:]
            if rel.split("/", 1)[0] not in (".lock", ".catalog"):
                objects[rel] = fs.cat_file(path)
        return cls(objects)

    def steps(self, op) -> list[dict[str, bytes]]:
        """Apply ``op``; the states after each of its parts (one, but one per object deleted by a
        recursive delete)."""
        kind, path = op.kind, op.path
        if kind == "create":
            self.uploads[path] = bytearray()
        elif kind == "write":
            self.uploads[path] += op.data
        elif kind == "close":
            self.objects[path] = bytes(self.uploads.pop(path))
        elif kind == "abort":
            self.uploads.pop(path, None)
        elif kind == "write_bytes":
            self.objects[path] = bytes(op.data)
        elif kind == "remove":
            self.objects.pop(path, None)
        elif kind == "remove_tree":
            below = [p for p in self.objects if p == path or p.startswith(path + "/")]
            parts = []
            for name in sorted(below, key=lambda p: (p.endswith("manifest.json"), p)):
                del self.objects[name]
                parts.append(dict(self.objects))
            return parts or [dict(self.objects)]
        return [dict(self.objects)]

    def state(self) -> State:
        return tuple(sorted(self.objects.items()))


def materialize(state: State, directory: Path) -> Path:
    """Write ``state`` under ``directory`` (created); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for rel, data in state:
        if rel.endswith("/"):
            (directory / rel).mkdir(parents=True, exist_ok=True)
        else:
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            (directory / rel).write_bytes(data)
    return directory


class LocalObjectStore(LocalStorage):
    """A local directory read and cleaned up as an object store is (no atomic rename: the
    manifest-last strategy), for checking object-store crash states without a server."""

    atomic_rename = False

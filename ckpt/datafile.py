"""A rank's data files: chunk payloads back to back, each checksummed, big ones 4 KiB-aligned.

Writing: payloads are produced lazily one at a time (a tensor is turned into bytes only when its
turn comes), hashed on a helper thread while the same bytes are being written, and the file is
fsync'd before the rank reports success. Reading: a chunk is fetched with positional reads straight
into the caller's buffer (the live tensor when the layouts match), its checksum verified, and every
file access is confined to the checkpoint directory.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from .errors import CorruptCheckpointError, InvalidManifestError
from .fileio import Writeback, aligned, checksum, pread_into, write_all
from .format import Blob


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array on the host (a view when already host-contiguous)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy()


@dataclass
class Payload:
    """One thing to store: ``produce()`` returns its bytes when it is written."""

    key: object  # handed back with the resulting Blob
    produce: Callable[[], np.ndarray | bytes]
    nbytes: int  # estimate, for balancing work across files


def write_file(path: Path, rel_name: str, payloads: Iterable[Payload]) -> list[tuple[object, Blob]]:
    """Write ``payloads`` into a new file at ``path``; fsync it; return where each one went."""
    placed: list[tuple[object, int, int, Future]] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writeback = Writeback(fd)
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as hasher:
            end = 0
            for payload in payloads:
                data = payload.produce()
                view = memoryview(data).cast("B")
                start = aligned(end, len(view))
                if start > end:
                    write_all(fd, memoryview(bytes(start - end)))
                digest = hasher.submit(checksum, view)
                write_all(fd, view)
                end = start + len(view)
                writeback.advance(end)
                placed.append((payload.key, start, len(view), digest))
        os.fsync(fd)
    finally:
        os.close(fd)
    return [
        (key, Blob(file=rel_name, offset=start, length=length, checksum=digest.result()))
        for key, start, length, digest in placed
    ]


class DataFiles:
    """Read access to the data files of one checkpoint directory."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self._fds: dict[str, tuple[int, int]] = {}

    def _open(self, name: str) -> tuple[int, int]:
        if name not in self._fds:
            path = (self.root / name).resolve()
            if not path.is_relative_to(self.root):
                raise InvalidManifestError(f"data file {name!r} resolves outside the checkpoint", file=name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.root}: data file {name} is missing", file=name) from None
            self._fds[name] = (fd, os.fstat(fd).st_size)
        return self._fds[name]

    def check(self, blob: Blob, *, what: str) -> int:
        """Refuse a blob that lies beyond the end of its file; call before allocating for it."""
        fd, size = self._open(blob.file)
        if blob.offset + blob.length > size:
            raise CorruptCheckpointError(
                f"{self.root}: {blob.file} is truncated ({size} bytes) - {what} needs bytes "
                f"{blob.offset}..{blob.offset + blob.length}",
                file=blob.file, tensor=what,
            )
        return fd

    def read_into(self, blob: Blob, buffer: memoryview, *, what: str) -> None:
        """Fill ``buffer`` (exactly ``blob.length`` bytes) with the blob's stored bytes, unverified."""
        fd = self.check(blob, what=what)
        if pread_into(fd, buffer, blob.offset) != blob.length:
            raise CorruptCheckpointError(f"{self.root}: short read of {what} from {blob.file}",
                                         file=blob.file, tensor=what)

    def read(self, blob: Blob, *, what: str) -> bytearray:
        """The blob's stored bytes, verified."""
        self.check(blob, what=what)
        buffer = bytearray(blob.length)
        self.read_into(blob, memoryview(buffer), what=what)
        self.verify(blob, checksum(buffer), what=what)
        return buffer

    def verify(self, blob: Blob, digest: str, *, what: str) -> None:
        if digest != blob.checksum:
            raise CorruptCheckpointError(
                f"{self.root}: checksum mismatch for {what} in {blob.file} at byte {blob.offset} "
                f"(stored {blob.checksum}, read {digest})",
                file=blob.file, tensor=what,
            )

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "DataFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

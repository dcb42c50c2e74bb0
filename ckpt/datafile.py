"""A rank's data files: chunk payloads back to back, each checksummed, big ones 4 KiB-aligned.

Writing: payloads are produced lazily one at a time (a tensor is turned into bytes only when its
turn comes), hashed on a helper thread while the same bytes are being written, and the file is
fsync'd before the rank reports success. Reading: a chunk is fetched with positional reads straight
into the caller's buffer (the live tensor when the layouts match), its checksum verified, and every
file access is confined to the checkpoint directory.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from .codec import Encoded
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
    """One thing to store: ``produce()`` returns its bytes (or an :class:`~ckpt.codec.Encoded`)
    when it is written."""

    key: object  # handed back with the resulting Blob
    produce: Callable[[], np.ndarray | bytes | Encoded]
    nbytes: int  # estimate, for balancing work across files


def _in_order(payloads: Iterable[Payload], pool: ThreadPoolExecutor | None, window: int):
    """``(payload, produced)`` in order; with a pool, up to ``window`` payloads are produced ahead
    (encoding in parallel while earlier ones are written)."""
    if pool is None:
        for payload in payloads:
            yield payload, payload.produce()
        return
    pending: deque = deque()
    for payload in payloads:
        pending.append((payload, pool.submit(payload.produce)))
        if len(pending) >= window:
            done, future = pending.popleft()
            yield done, future.result()
    while pending:
        done, future = pending.popleft()
        yield done, future.result()


def write_file(path: Path, rel_name: str, payloads: Iterable[Payload], *,
               encoders: ThreadPoolExecutor | None = None, window: int = 4) -> list[tuple[object, Blob]]:
    """Write ``payloads`` into a new file at ``path``; fsync it; return where each one went."""
    placed: list[tuple[object, int, int, Future, Encoded | None]] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writeback = Writeback(fd)
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as hasher:
            end = 0
            for payload, data in _in_order(payloads, encoders, window):
                encoded = data if isinstance(data, Encoded) else None
                view = memoryview(encoded.data if encoded else data).cast("B")
                start = aligned(end, len(view))
                if start > end:
                    write_all(fd, memoryview(bytes(start - end)))
                digest = hasher.submit(checksum, view)
                write_all(fd, view)
                end = start + len(view)
                writeback.advance(end)
                placed.append((payload.key, start, len(view), digest, encoded))
        os.fsync(fd)
    finally:
        os.close(fd)
    return [
        (key, Blob(file=rel_name, offset=start, length=length, checksum=digest.result(),
                   **({} if enc is None else {"codec": enc.codec, "raw_length": enc.raw_length, "planes": enc.planes})))
        for key, start, length, digest, enc in placed
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

"""The wire of a partner copy (:mod:`ckpt.memory.partner`): its version, frames and bounds, the file
table's check, and the channel it travels on. Sender to receiver, point-to-point CPU tensors on a
gloo group:

    head     int64[4]  [VERSION, status, file count, table bytes]      status FAILED: nothing follows
    table    uint8[n]  JSON [[name, size], ...]: ``manifest.json`` first, then the data files (sorted)
    frames   int64[2]  [kind, value], per file in table order:
               PIECE, n    n bytes of the file follow (uint8[n], 0 < n <= PIECE_BYTES)
               END, d      the file is over; d: the xxh3-64 of its bytes as the sender read them
               FAILED, 0   the sender failed (its own error says why): nothing more follows

The manifest goes first (version 2; version 1 sent it last) so that the receiver checks every blob
of a data file against it while the file's bytes arrive. :func:`check_table` (both ends, before
anything is written): at most :data:`MAX_FILES` entries in :data:`MAX_TABLE_BYTES`, the manifest
first and once, data file names as :func:`ckpt.format.is_data_file_name` takes them (no separator
beyond ``data/``, no ``..``), each once, sizes within the format's limits.
"""

from __future__ import annotations

import torch

from ..collective import host_side
from ..errors import CheckpointError, CorruptCheckpointError, InvalidOptionError
from ..format import MANIFEST_NAME, MAX_BYTES, is_data_file_name
from ..read import MAX_MANIFEST_BYTES
from ..read.exchange import Exchange

VERSION = 2
PIECE_BYTES = 16 << 20
MAX_FILES = 4096
MAX_TABLE_BYTES = 1 << 20
FAILED, OK = 0, 1  # head status
PIECE, END = 1, 2  # frame kinds (FAILED too)


class SenderFailedError(CheckpointError):
    """The sending rank could not send its checkpoint (its own error says why)."""


# -- the table ------------------------------------------------------------------------------------
def check_table(table) -> list[tuple[str, int]]:
    """``table`` (decoded JSON) as ``[(name, size), ...]`` when a sender may send it (see the module
    docstring), else :class:`CorruptCheckpointError` saying why."""
    if not isinstance(table, list) or not 1 <= len(table) <= MAX_FILES:
        raise CorruptCheckpointError(f"a file table of 1 to {MAX_FILES} entries was expected, not {table!r:.200}")
    files: list[tuple[str, int]] = []
    seen = set()
    for index, entry in enumerate(table):
        first = index == 0
        name, size = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
        if (not isinstance(size, int) or isinstance(size, bool) or first != (name == MANIFEST_NAME)
                or not (first or is_data_file_name(name)) or name in seen
                or not 0 <= size <= (MAX_MANIFEST_BYTES if first else MAX_BYTES)):
            raise CorruptCheckpointError(f"file table entry {entry!r:.200}: {MANIFEST_NAME} (first) or a data "
                                         "file name (once) and a size within bounds was expected")
        files.append((name, size))
        seen.add(name)
    return files


# -- the channel ----------------------------------------------------------------------------------
SENDING, RECEIVING = "a partner copy was sent to it", "it was to send a partner copy"  # PeerLostError's words


def channel(group) -> Exchange:
    """Point-to-point sends on ``group``, refused unless they travel in host memory (gloo)."""
    if host_side(group) is None:
        raise InvalidOptionError("group", str(torch.distributed.get_backend(group)),
                                 "a gloo process group: partner copies travel in host memory")
    return Exchange(group)


def ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def signed(digest: int) -> int:
    """An unsigned 64-bit digest as an int64 tensor carries it."""
    return digest - (1 << 64) if digest >= 1 << 63 else digest


def receive_tensor(exchange: Exchange, source: int, tensor: torch.Tensor) -> torch.Tensor:
    exchange.receive_into(source, tensor, RECEIVING)
    return tensor


class Kept(bytearray):
    """The manifest's bytes in memory: read like a data file by the sender, written like one by the
    receiver (whose commit writes it, last)."""

    size = property(len)

    def read_into(self, buffer: memoryview, offset: int) -> int:
        piece = self[offset: offset + len(buffer)]
        buffer[: len(piece)] = piece
        return len(piece)

    def write(self, data) -> None:
        self.extend(data)

    def close(self) -> int:
        return len(self)

    def abort(self) -> None:
        pass

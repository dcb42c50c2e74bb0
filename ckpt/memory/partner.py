"""Partner copies: which rank holds a rank's copy, and a committed rank checkpoint copied from one rank
to another over a gloo process group (host memory only), verified on arrival.

Who holds whose copy is :mod:`ckpt.memory.nodes`'s. A copy (:func:`send_checkpoint` / :func:`receive_checkpoint`, or
:func:`swap`: both at once) moves an ordinary checkpoint of ours bitwise; ``to`` and ``source`` are
ranks of ``group``. Wire format, sender to receiver (point-to-point, CPU tensors):

    head     int64[4]  [VERSION, status, file count, table bytes]      status FAILED: nothing follows
    table    uint8[n]  JSON [[name, size], ...]: the data files (sorted), then ``manifest.json``
    frames   int64[2]  [kind, value], per file in table order:
               PIECE, n    n bytes of the file follow (uint8[n], 0 < n <= PIECE_BYTES)
               END, d      the file is over; d: the xxh3-64 of its bytes as the sender read them
               FAILED, 0   the sender failed (its own error says why): nothing more follows

Both ends check the table (:func:`check_table`: at most :data:`MAX_FILES` entries in
:data:`MAX_TABLE_BYTES`, data file names as :func:`ckpt.format.is_data_file_name` takes them — no
separator beyond ``data/``, no ``..`` — each once, the manifest last, sizes within the format's
limits) before anything is written. Memory: one piece (16 MiB) per end at a time, and the manifest.

The receiver writes through the commit protocol (:mod:`ckpt.commit`): a fresh attempt, each file's
size and xxh3-64 checked against the sender's as it arrives, the manifest's data files against those
received, every blob against the manifest (:func:`ckpt.read.verify_blobs`), the manifest last. Any
failure aborts the attempt (nothing stays) and raises a :class:`~ckpt.errors.CheckpointError` naming
the source rank and the file (a mismatch: :class:`~ckpt.errors.CorruptCheckpointError`; the sender's
failure: :class:`SenderFailedError`). Nobody hangs: a failing sender sends its status before it
raises; a failing receiver drains the rest of the stream; a peer whose process died is not waited for
(:class:`~ckpt.errors.PeerLostError`). A stream the receiver cannot follow (another version, a frame
out of bounds: another build, or damage in passing) is refused at once; its sender then fails at the
group's timeout.
"""

from __future__ import annotations

import json
import threading
from contextlib import suppress
from functools import partial

import torch
import xxhash

from .. import commit
from ..collective import host_side
from ..errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, InvalidOptionError,
                      PeerLostError)
from ..format import MANIFEST_NAME, MAX_BYTES, Manifest, is_data_file_name
from ..read import MAX_MANIFEST_BYTES, DataFiles, read_manifest_bytes, verify_blobs
from ..read.exchange import Exchange
from ..storage import Location

VERSION = 1
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
        last = index == len(table) - 1
        name, size = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
        if (not isinstance(size, int) or isinstance(size, bool) or last != (name == MANIFEST_NAME)
                or not (last or is_data_file_name(name)) or name in seen
                or not 0 <= size <= (MAX_MANIFEST_BYTES if last else MAX_BYTES)):
            raise CorruptCheckpointError(f"file table entry {entry!r:.200}: a data file name (once) or "
                                         f"{MANIFEST_NAME} (last) and a size within bounds was expected")
        files.append((name, size))
        seen.add(name)
    return files


# -- the channel ----------------------------------------------------------------------------------
SENDING, RECEIVING = "a partner copy was sent to it", "it was to send a partner copy"  # PeerLostError's words


def _channel(group) -> Exchange:
    """Point-to-point sends on ``group``, refused unless they travel in host memory (gloo)."""
    if host_side(group) is None:
        raise InvalidOptionError("group", str(torch.distributed.get_backend(group)),
                                 "a gloo process group: partner copies travel in host memory")
    return Exchange(group)


def _ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _signed(digest: int) -> int:
    """An unsigned 64-bit digest as an int64 tensor carries it."""
    return digest - (1 << 64) if digest >= 1 << 63 else digest


def _receive(exchange: Exchange, source: int, tensor: torch.Tensor) -> torch.Tensor:
    exchange.receive_into(source, tensor, RECEIVING)
    return tensor


class _Kept(bytearray):
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


# -- sending --------------------------------------------------------------------------------------
def send_checkpoint(location: Location | None, to: int, group, *,
                    committed: tuple[Manifest, bytes] | None = None) -> None:
    """Send the committed checkpoint at ``location`` to rank ``to`` of ``group`` (see the module
    docstring). ``location`` None (nothing to send) or unreadable: a failed status goes instead,
    so the receiver is released; then the error is raised. ``committed``: its manifest and the
    manifest's bytes, when the caller has just committed them (else read from ``location``)."""
    exchange = _channel(group)
    files = None if location is None else DataFiles(location)
    try:
        try:
            if location is None:
                raise CheckpointNotFoundError(f"no checkpoint to send to rank {to}")
            manifest, raw = committed if committed is not None else read_manifest_bytes(location)
            handles = [(name, files.open(name)) for name in sorted(manifest.data_files())]  # sizes: verify_blobs'
            handles.append((MANIFEST_NAME, _Kept(raw)))
            table = json.dumps([[name, handle.size] for name, handle in handles]).encode()
            check_table(json.loads(table))
        except BaseException:
            _tell_failed(exchange, to, _ints(VERSION, FAILED, 0, 0))
            raise
        listing = torch.frombuffer(bytearray(table), dtype=torch.uint8)
        exchange.send((to,), _ints(VERSION, OK, len(handles), len(table)), listing, SENDING)
        buffer = memoryview(bytearray(max(1, min(PIECE_BYTES, max(handle.size for _, handle in handles)))))
        for name, handle in handles:
            _send_file(exchange, to, name, handle, buffer)
    finally:
        if files is not None:
            files.close()


def _send_file(exchange: Exchange, to: int, name: str, handle, buffer: memoryview) -> None:
    """One file's frames; a failure to read it is told (FAILED) before it is raised."""
    hasher, position = xxhash.xxh3_64(), 0
    while position < handle.size:
        piece = buffer[: min(len(buffer), handle.size - position)]
        try:
            if handle.read_into(piece, position) != len(piece):
                raise CorruptCheckpointError(f"{name} ended early at byte {position}", file=name)
        except BaseException:
            _tell_failed(exchange, to, _ints(FAILED, 0))
            raise
        hasher.update(piece)
        exchange.send((to,), _ints(PIECE, len(piece)), torch.frombuffer(piece, dtype=torch.uint8), SENDING)
        position += len(piece)
    exchange.send((to,), _ints(END, _signed(hasher.intdigest())), None, SENDING)


def _tell_failed(exchange: Exchange, to: int, status: torch.Tensor) -> None:
    """The sender's failure, told so that the receiver is released (a receiver gone already: no news)."""
    with suppress(PeerLostError):
        exchange.send((to,), status, None, SENDING)


# -- receiving ------------------------------------------------------------------------------------
def receive_checkpoint(target: Location | None, source: int, group, *, overwrite: bool = False) -> None:
    """Receive the checkpoint rank ``source`` of ``group`` sends and commit it at ``target`` (see the
    module docstring). ``target`` None (nowhere to put it): the stream is received and discarded, so
    the sender is released, then refused."""
    exchange = _channel(group)
    attempt, error = None, None
    try:
        try:
            if target is None:
                raise CheckpointError(f"nowhere to put the checkpoint rank {source} sends")
            attempt = commit.begin(target, overwrite=overwrite)
        except (CheckpointError, OSError) as exc:
            error = exc  # raised once the stream is over
        manifest, raw = _receive_files(exchange, source, attempt, error)
        try:
            verify_blobs(attempt.directory, manifest)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"the checkpoint received from rank {source} does not verify: {exc}",
                                         path=str(target), file=exc.file, tensor=exc.tensor) from None
        commit.finish(attempt, manifest, raw=raw)
    except BaseException:
        if attempt is not None:
            commit.abort(attempt)
        raise


def _receive_files(exchange: Exchange, source: int, attempt, error: BaseException | None) -> tuple[Manifest, bytes]:
    """Follow the stream from ``source``, each file written into ``attempt`` while nothing failed;
    the manifest and its bytes. The first failure is raised once the stream is over (at once when it
    ends early or cannot be followed)."""
    version, status, count, table_bytes = _receive(exchange, source, torch.zeros(4, dtype=torch.int64)).tolist()
    if version != VERSION:
        raise CorruptCheckpointError(f"rank {source} sends partner copies in version {version}, not {VERSION}")
    if status != OK:
        raise SenderFailedError(f"rank {source} could not send its checkpoint (its own error says why)")
    if not (1 <= count <= MAX_FILES and 0 < table_bytes <= MAX_TABLE_BYTES):
        raise CorruptCheckpointError(f"rank {source} announced {count} files in a table of {table_bytes} bytes")
    table = _receive(exchange, source, torch.empty(table_bytes, dtype=torch.uint8))
    files = [(None, PIECE_BYTES)] * count  # a refused table: the stream is drained all the same
    try:
        listed = check_table(json.loads(bytes(table.numpy())))
        if len(listed) != count:
            raise CorruptCheckpointError(f"{count} files announced, {len(listed)} listed")
        files = listed
    except (ValueError, RecursionError, CheckpointError) as exc:
        error = error or CorruptCheckpointError(f"rank {source}'s file table is refused: {exc}")
    buffer = torch.empty(max(1, min(PIECE_BYTES, max(size for _, size in files))), dtype=torch.uint8)
    kept, received = _Kept(), set()

    def create(name: str):
        return kept if name == MANIFEST_NAME else attempt.directory.storage.create((attempt.directory / name).path)

    for name, size in files:
        failure = _receive_file(exchange, source, name, size, buffer, partial(create, name), error)
        error = error or failure
        received.add(name)
    if error is not None:
        raise error
    raw = bytes(kept)
    manifest = Manifest.from_json(raw, source=f"the {MANIFEST_NAME} received from rank {source}")
    if manifest.data_files() | {MANIFEST_NAME} != received:
        raise CorruptCheckpointError(f"the manifest received from rank {source} references "
                                     f"{sorted(manifest.data_files())}; sent: {sorted(received)}", file=MANIFEST_NAME)
    return manifest, raw


def _receive_file(exchange: Exchange, source: int, name: str | None, size: int, buffer: torch.Tensor, create,
                  failure: BaseException | None) -> BaseException | None:
    """One file's frames, its bytes into ``create()`` while nothing failed, its size and xxh3-64
    checked against the sender's; the file's failure (None: it is in place), its frames all in."""
    out, hasher, got, frame = None, xxhash.xxh3_64(), 0, torch.zeros(2, dtype=torch.int64)
    try:
        if failure is None:
            try:
                out = create()
            except (CheckpointError, OSError) as exc:
                failure = exc
        while True:
            kind, value = _receive(exchange, source, frame).tolist()
            if kind == END:
                break
            if kind == FAILED:
                raise SenderFailedError(f"rank {source} failed while sending {name} (its own error says why)",
                                        file=name)
            if kind != PIECE or not 0 < value <= buffer.numel():
                raise CorruptCheckpointError(f"rank {source} sent a frame [{kind}, {value}] out of bounds", file=name)
            piece = _receive(exchange, source, buffer[:value])
            got += value
            if failure is None and got <= size:
                data = memoryview(piece.numpy())
                hasher.update(data)
                try:
                    out.write(data)
                except OSError as exc:
                    failure = exc
        if failure is None and (got != size or _signed(hasher.intdigest()) != value):
            failure = CorruptCheckpointError(f"{name} received from rank {source} differs from what it read ({got} "
                                             f"bytes of {size}; xxh3-64 {hasher.intdigest():016x}, the sender's "
                                             f"{value % (1 << 64):016x})", file=name)
        if failure is None:
            try:
                out.close()
                out = None
            except (CheckpointError, OSError) as exc:
                failure = exc
    finally:
        if out is not None:
            out.abort()
    return failure


# -- both ways at once ----------------------------------------------------------------------------
def swap(send: Location | None, to: int | None, receive: Location | None, source: int | None, group, *,
         overwrite: bool = False, committed: tuple[Manifest, bytes] | None = None) -> None:
    """Send ``send`` to rank ``to`` while receiving rank ``source``'s checkpoint into ``receive`` (the
    send on a thread of its own, so a pair sending to each other, or a ring, never waits on itself);
    ``to`` / ``source`` None: that side is skipped; ``committed``: ``send``'s manifest and its bytes
    (:func:`send_checkpoint`). Every failure is raised once both sides are done (the send's, with
    the receive's attached as a note)."""
    failures: dict[int, BaseException] = {}

    def side(order: int, call, *args) -> None:
        try:
            call(*args)
        except BaseException as exc:  # an interrupt too: raised once the other side is done
            failures[order] = exc

    thread = threading.Thread(target=side, args=(0, partial(send_checkpoint, committed=committed), send, to, group),
                              name="ckpt-partner-send", daemon=True)
    if to is not None:
        thread.start()
    if source is not None:
        side(1, partial(receive_checkpoint, overwrite=overwrite), receive, source, group)
    if to is not None:
        thread.join()
    errors = [failures[order] for order in sorted(failures)]
    for other in errors[1:]:
        errors[0].add_note(f"also: {type(other).__name__}: {other}")
    if errors:
        raise errors[0]

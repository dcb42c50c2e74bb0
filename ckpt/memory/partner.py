"""Partner copies: a committed rank checkpoint copied from one rank to another over a gloo process
group (host memory only), verified on arrival.

Who holds whose copy is :mod:`ckpt.memory.nodes`'s; the wire (frames, bounds, the file table's
check) is :mod:`ckpt.memory.wire`'s. A copy (:func:`send_checkpoint` / :func:`receive_checkpoint`,
or :func:`swap` and :func:`exchange_copies`: sends and a receive at once) moves an ordinary
checkpoint of ours bitwise; ``to`` and ``source`` are ranks of ``group``. Each end handles a piece
on a thread of its own while it reads or receives the next (:class:`ckpt.memory.overlap.Behind`):
memory, two pieces (2 x 16 MiB) per end, and the manifest.

The receiver writes through the commit protocol (:mod:`ckpt.commit`): a fresh attempt; the manifest
first, parsed and validated, its data files the table's and their sizes the manifest's; each data
file's size and xxh3-64 checked against the sender's, and every blob of it (and every block table)
against the manifest while its bytes pass (:class:`ckpt.memory.arrival.ArrivingFile`, the checks of
:func:`ckpt.read.verify_blobs`); the manifest last. Any failure aborts the attempt (nothing stays)
and raises a :class:`~ckpt.errors.CheckpointError` naming the source rank and the file (a mismatch:
:class:`~ckpt.errors.CorruptCheckpointError` — "differs from what it read" for bytes damaged in
passing, "does not verify" for bytes damaged where the sender read them; the sender's failure:
:class:`SenderFailedError`). Nobody hangs: a failing sender sends its status before it raises; a
failing receiver drains the rest of the stream; a peer whose process died is not waited for
(:class:`~ckpt.errors.PeerLostError`). A stream the receiver cannot follow (another version, a
frame out of bounds: another build, or damage in passing) is refused at once; its sender then
fails at the group's timeout.

Why blobs are checked in passing and the received files are not read back (issue 38, measured on
a 400 MB rank checkpoint, /dev/shm to /dev/shm on loopback): the receiver used to write each file,
then re-read every blob against the manifest (:func:`ckpt.read.verify_blobs`), and the load read
the files a third time — ~0.15 s of the receiver's 0.6 s of CPU, and a serial pass in its wall
time. Hashing costs little (xxh3: ~0.02 s per 400 MB); the copies, page faults and waiting on each
other cost. The in-passing check keeps every guarantee the read-back gave — a byte damaged on the
sender's side (its tmpfs) is refused before the copy is committed, as before, so a damaged copy
never counts for a memory step — and the load still verifies every blob it reads (the read path's
own rule, :mod:`ckpt.read.source`), so a byte flipped in the received file after its commit is
caught there, before the state is used. What it gives up: nothing the read-back saw and it does
not — a flip in the receiver's RAM between the write and the load, which the read-back could not
rule out either for the time after it ran. ``fsync`` on a RAM file system is free (measured: 0.00
s), so the commit protocol is kept as it is. Together with the overlap of reading, sending and
writing: the fetch's wall time 0.8-3.3 s -> 0.5-0.7 s, the receiver's CPU 0.6-0.68 -> 0.35-0.38 s
(load average 10-16 on 2 shared cores; /tmp/h9/fetch_bench.py in the helper's report).
"""

from __future__ import annotations

import json
import threading
from contextlib import suppress
from functools import partial

import torch
import xxhash

from .. import commit
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, PeerLostError
from ..format import MANIFEST_NAME, Manifest
from ..read import DataFiles, read_manifest_bytes
from ..read.exchange import Exchange
from ..storage import Location
from .arrival import ArrivingFile, blobs_of
from .overlap import Behind
from .wire import (END, FAILED, MAX_FILES, MAX_TABLE_BYTES, OK, PIECE, PIECE_BYTES, SENDING, VERSION, Kept,
                   SenderFailedError, channel, check_table, ints, receive_tensor, signed)

# -- sending --------------------------------------------------------------------------------------
def send_checkpoint(location: Location | None, to: int, group, *,
                    committed: tuple[Manifest, bytes] | None = None) -> None:
    """Send the committed checkpoint at ``location`` to rank ``to`` of ``group`` (see the module
    docstring). ``location`` None (nothing to send) or unreadable: a failed status goes instead,
    so the receiver is released; then the error is raised. ``committed``: its manifest and the
    manifest's bytes, when the caller has just committed them (else read from ``location``)."""
    exchange = channel(group)
    files = None if location is None else DataFiles(location)
    try:
        try:
            if location is None:
                raise CheckpointNotFoundError(f"no checkpoint to send to rank {to}")
            manifest, raw = committed if committed is not None else read_manifest_bytes(location)
            handles = [(MANIFEST_NAME, Kept(raw))]  # first: the receiver checks each blob as it arrives
            handles += [(name, files.open(name)) for name in sorted(manifest.data_files())]  # sizes as stored
            table = json.dumps([[name, handle.size] for name, handle in handles]).encode()
            check_table(json.loads(table))
        except BaseException:
            _tell_failed(exchange, to, ints(VERSION, FAILED, 0, 0))
            raise
        listing = torch.frombuffer(bytearray(table), dtype=torch.uint8)
        exchange.send((to,), ints(VERSION, OK, len(handles), len(table)), listing, SENDING)
        with Behind(min(PIECE_BYTES, max(handle.size for _, handle in handles)), name="ckpt-partner-send") as behind:
            for name, handle in handles:
                _send_file(exchange, to, name, handle, behind)
    finally:
        if files is not None:
            files.close()


def _send_file(exchange: Exchange, to: int, name: str, handle, behind: Behind) -> None:
    """One file's frames, each piece sent while the next is read (:class:`Behind`); a failure to
    read it is told (FAILED, after the pieces read before it) before it is raised."""
    hasher, position = xxhash.xxh3_64(), 0

    def send(piece: torch.Tensor) -> None:
        exchange.send((to,), ints(PIECE, piece.numel()), piece, SENDING)

    while position < handle.size:
        buffer = behind.buffer()
        piece = memoryview(buffer.numpy())[: min(buffer.numel(), handle.size - position)]
        try:
            if handle.read_into(piece, position) != len(piece):
                raise CorruptCheckpointError(f"{name} ended early at byte {position}", file=name)
        except BaseException:
            behind.settle()
            _tell_failed(exchange, to, ints(FAILED, 0))
            raise
        hasher.update(piece)
        behind.hand(len(piece), send)
        position += len(piece)
    behind.wait()
    exchange.send((to,), ints(END, signed(hasher.intdigest())), None, SENDING)


def _tell_failed(exchange: Exchange, to: int, status: torch.Tensor) -> None:
    """The sender's failure, told so that the receiver is released (a receiver gone already: no news)."""
    with suppress(PeerLostError):
        exchange.send((to,), status, None, SENDING)


# -- receiving ------------------------------------------------------------------------------------
def receive_checkpoint(target: Location | None, source: int, group, *, overwrite: bool = False) -> None:
    """Receive the checkpoint rank ``source`` of ``group`` sends and commit it at ``target`` (see the
    module docstring). ``target`` None (nowhere to put it): the stream is received and discarded, so
    the sender is released, then refused."""
    exchange = channel(group)
    attempt, error = None, None
    try:
        try:
            if target is None:
                raise CheckpointError(f"nowhere to put the checkpoint rank {source} sends")
            attempt = commit.begin(target, overwrite=overwrite)
        except (CheckpointError, OSError) as exc:
            error = exc  # raised once the stream is over
        manifest, raw = _receive_files(exchange, source, attempt, error)
        commit.finish(attempt, manifest, raw=raw)
    except BaseException:
        if attempt is not None:
            commit.abort(attempt)
        raise


def _receive_files(exchange: Exchange, source: int, attempt, error: BaseException | None) -> tuple[Manifest, bytes]:
    """Follow the stream from ``source``: the manifest, then each data file written into ``attempt``
    and checked against it while nothing failed; the manifest and its bytes. The first failure is
    raised once the stream is over (at once when it ends early or cannot be followed)."""
    version, status, count, table_bytes = receive_tensor(exchange, source, torch.zeros(4, dtype=torch.int64)).tolist()
    if version != VERSION:
        raise CorruptCheckpointError(f"rank {source} sends partner copies in version {version}, not {VERSION}")
    if status != OK:
        raise SenderFailedError(f"rank {source} could not send its checkpoint (its own error says why)")
    if not (1 <= count <= MAX_FILES and 0 < table_bytes <= MAX_TABLE_BYTES):
        raise CorruptCheckpointError(f"rank {source} announced {count} files in a table of {table_bytes} bytes")
    table = receive_tensor(exchange, source, torch.empty(table_bytes, dtype=torch.uint8))
    files = [(None, PIECE_BYTES)] * count  # a refused table: the stream is drained all the same
    try:
        listed = check_table(json.loads(bytes(table.numpy())))
        if len(listed) != count:
            raise CorruptCheckpointError(f"{count} files announced, {len(listed)} listed")
        files = listed
    except (ValueError, RecursionError, CheckpointError) as exc:
        error = error or CorruptCheckpointError(f"rank {source}'s file table is refused: {exc}")
    with Behind(min(PIECE_BYTES, max(size for _, size in files)), name="ckpt-partner-receive") as behind:
        manifest, kept = _receive_all(exchange, source, attempt, files, behind, error)
    return manifest, bytes(kept)


def _receive_all(exchange: Exchange, source: int, attempt, files: list, behind: Behind,
                 error: BaseException | None) -> tuple[Manifest, "Kept"]:
    """The files of the table: the manifest (parsed, its data files the table's), then each data
    file, checked against it; the manifest and its bytes."""
    kept = Kept()
    failure = _receive_file(exchange, source, files[0][0], files[0][1], behind, lambda: (kept, None), error)
    error = error or failure
    manifest, blobs = None, {}
    if error is None:
        try:
            manifest = Manifest.from_json(bytes(kept), source=f"the {MANIFEST_NAME} received from rank {source}")
            if manifest.data_files() != {name for name, _ in files[1:]}:
                raise CorruptCheckpointError(f"the manifest received from rank {source} references "
                                             f"{sorted(manifest.data_files())}; sent: {[n for n, _ in files[1:]]}",
                                             file=MANIFEST_NAME)
            blobs = blobs_of(manifest)
        except CheckpointError as exc:
            error = exc

    def open_file(name: str, size: int):
        check = ArrivingFile(name, size, blobs[name], expected_size=manifest.files.get(name))  # refused: nothing made
        return attempt.directory.storage.create((attempt.directory / name).path), check

    for name, size in files[1:]:
        failure = _receive_file(exchange, source, name, size, behind, partial(open_file, name, size), error)
        error = error or failure  # every file's frames taken all the same: the sender is released
    if error is not None:
        raise error
    return manifest, kept


def _receive_file(exchange: Exchange, source: int, name: str | None, size: int, behind: Behind, open_file,
                  failure: BaseException | None) -> BaseException | None:
    """One file's frames: while nothing failed, its bytes into the writer ``open_file()`` gives and
    through the :class:`ArrivingFile` check with it (None: none), a piece checked and written while
    the next is received (:class:`Behind`); its size and xxh3-64 checked against the sender's. The
    file's failure (None: it is in place), its frames all in. Bytes that differ from the sender's
    are named as that (damaged in passing) before a failed blob check (damaged where it read them)."""
    out, check, hasher, got, frame = None, None, xxhash.xxh3_64(), 0, torch.zeros(2, dtype=torch.int64)
    taken: dict[str, BaseException] = {}  # the thread's failures: "unverified" (a blob), "write"

    def take(piece: torch.Tensor) -> None:  # on Behind's thread, one piece at a time
        data = memoryview(piece.numpy())
        hasher.update(data)
        if taken:
            return
        try:
            if check is not None:
                check.update(data)
            out.write(data)
        except CorruptCheckpointError as exc:
            taken["unverified"] = exc  # the hash goes on: damage in passing is named as that
        except OSError as exc:
            taken["write"] = exc

    try:
        if failure is None:
            try:
                out, check = open_file()
            except (CheckpointError, OSError) as exc:
                failure = exc
        while True:
            kind, value = receive_tensor(exchange, source, frame).tolist()
            if kind == END:
                break
            if kind == FAILED:
                raise SenderFailedError(f"rank {source} failed while sending {name} (its own error says why)",
                                        file=name)
            if kind != PIECE or not 0 < value <= behind.buffer().numel():
                raise CorruptCheckpointError(f"rank {source} sent a frame [{kind}, {value}] out of bounds", file=name)
            receive_tensor(exchange, source, behind.buffer()[:value])
            got += value
            if failure is None and got <= size:
                behind.hand(value, take)
        behind.wait()
        failure = failure or taken.get("write")
        if failure is None and (got != size or signed(hasher.intdigest()) != value):
            failure = CorruptCheckpointError(f"{name} received from rank {source} differs from what it read ({got} "
                                             f"bytes of {size}; xxh3-64 {hasher.intdigest():016x}, the sender's "
                                             f"{value % (1 << 64):016x})", file=name)
        if failure is None and not taken and check is not None:
            try:
                check.finish()
            except CorruptCheckpointError as exc:
                taken["unverified"] = exc
        unverified = taken.get("unverified")
        if failure is None and unverified is not None:
            failure = CorruptCheckpointError(f"the checkpoint received from rank {source} does not verify: "
                                             f"{unverified}", file=unverified.file, tensor=unverified.tensor)
        if failure is None:
            try:
                out.close()
                out = None
            except (CheckpointError, OSError) as exc:
                failure = exc
    finally:
        behind.settle()  # nothing of this file is written any more
        if out is not None:
            out.abort()
    return failure


# -- both ways at once ----------------------------------------------------------------------------
def swap(send: Location | None, to: int | None, receive: Location | None, source: int | None, group, *,
         overwrite: bool = False, committed: tuple[Manifest, bytes] | None = None) -> None:
    """Send ``send`` to rank ``to`` while receiving rank ``source``'s checkpoint into ``receive``
    (:func:`exchange_copies` of one send); ``to`` / ``source`` None: that side is skipped;
    ``committed``: ``send``'s manifest and its bytes (:func:`send_checkpoint`)."""
    exchange_copies([] if to is None else [(send, to)], receive, source, group, overwrite=overwrite,
                    committed=committed)


def exchange_copies(sends: list[tuple[Location | None, int]], receive: Location | None, source: int | None, group,
                    *, overwrite: bool = False, committed: tuple[Manifest, bytes] | None = None) -> None:
    """Send each ``(location, to)`` of ``sends`` in turn, on a thread of its own, while receiving rank
    ``source``'s checkpoint into ``receive`` (None: no receive), so that ranks sending to each other,
    or in a ring, never wait on themselves; ``committed``: the first send's manifest and its bytes.
    Every failure is raised once both sides are done (the first send's, with the others' attached as
    notes); a failed send does not keep the later ones from going (their receivers are waiting)."""
    failures: list[BaseException] = []

    def send_all() -> None:
        for index, (location, to) in enumerate(sends):
            try:
                send_checkpoint(location, to, group, committed=committed if index == 0 else None)
            except BaseException as exc:  # an interrupt too: raised once the other side is done
                failures.append(exc)

    thread = threading.Thread(target=send_all, name="ckpt-partner-send", daemon=True)
    if sends:
        thread.start()
    received = None
    if source is not None:
        try:
            receive_checkpoint(receive, source, group, overwrite=overwrite)
        except BaseException as exc:
            received = exc
    if sends:
        thread.join()
    errors = failures + ([received] if received is not None else [])
    for other in errors[1:]:
        errors[0].add_note(f"also: {type(other).__name__}: {other}")
    if errors:
        raise errors[0]

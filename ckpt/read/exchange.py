"""Replicated bytes read once, the exchange: each rank walks its :class:`~ckpt.read.assignment.RankShares`
in the global order, reading and sending the chunks it was given, receiving the others.

Transport: :class:`~ckpt.read.channel.Exchange`, point-to-point messages in host memory on the
host side of the load's process group (never through a device: a chunk is read into host memory,
or into its live tensor when that is on CPU, received into host memory, and copied into a live
device tensor by that tensor's own ``copy_``). Per receiver, one exchange is a header (status,
digest, bytes) and, when the status is good, the chunk's decoded bytes — or a batch's: small chunks
(:data:`~ckpt.read.assignment.SMALL_BYTES`) travel together, one buffer per batch.

Verification: the reader verifies the stored bytes against the manifest as every read does
(:class:`~ckpt.read.source.ChunkSource`), decodes them, and only then takes the xxh3-64 of the very
buffer it sends; the receiver hashes what it received and refuses a mismatch
(:class:`~ckpt.errors.CorruptCheckpointError`). So the bytes a receiver uses are the bytes the
reader verified, whatever happened in between.

Failure: whatever fails on a rank — its read, its check, a buffer it could not allocate, even the
set-up before its walk (``exchange_shared(error=...)``) — it keeps walking its exchanges so that no
peer waits forever: as a reader it sends a failed status (no data); as a receiver it still takes
every message its reader sends (into one piece of scratch when it has no buffer for them). It then
raises its first error, as a :class:`~ckpt.errors.CheckpointError` (an error of another kind is
wrapped in one, naming it); a receiver told of a peer's failure raises :class:`PeerReadFailed`,
which is no CheckpointError, so the caller unwrapping DCP's per-rank failures finds the reader's
own. A peer whose link fails (its process died: gloo's RuntimeError) is a
:class:`~ckpt.errors.PeerLostError` naming its rank; it is not addressed again, and the walk goes
on with the others (:attr:`Exchange.lost`, which ``ckpt.load`` raises when DCP's own collectives
then fail on the dead rank).

What a receiver takes into a live tensor before its hash is checked, and everything else a
failed load wrote, is put back by the load's rollback (:mod:`ckpt.read.rollback`).
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from typing import Any, Callable

import torch
import xxhash

from .assignment import RankShares
from .channel import Exchange, as_bytes
from ..errors import CheckpointError, CorruptCheckpointError, PeerLostError
from ..outcomes import LoadStats

_OK, _FAILED = 1, 0


class PeerReadFailed(RuntimeError):
    """Another rank could not read a chunk this rank was to receive from it."""


def _digest(raw: torch.Tensor) -> int:
    """xxh3-64 of a CPU uint8 tensor, as a signed 64-bit value (what an int64 header carries)."""
    value = xxhash.xxh3_64_intdigest(memoryview(raw.numpy()))
    return value - (1 << 64) if value >= 1 << 63 else value


def _failure(exc: BaseException, rank: int, what: str) -> BaseException:
    """``exc`` as this rank raises it: ours and :class:`PeerReadFailed` as they are, anything else
    (a MemoryError, a bug) wrapped in a :class:`CheckpointError` that names it."""
    if isinstance(exc, (CheckpointError, PeerReadFailed)):
        return exc
    error = CheckpointError(f"rank {rank} of the load's process group failed while exchanging {what} "
                            f"({type(exc).__name__}: {exc})", tensor=what)
    error.__cause__ = exc
    return error


def exchange_shared(shares: RankShares, exchange: Exchange, *, read: Callable[[Any, list], torch.Tensor],
                    target: Callable[[Any, list], torch.Tensor | None], deliver: Callable[[list, torch.Tensor], None],
                    chunk_of: Callable[[Any], tuple[tuple, torch.dtype]], items: dict, stats: LoadStats,
                    error: BaseException | None = None) -> None:
    """Walk ``shares`` (see the module docstring). ``read(index, items)``: the stored chunk, verified
    and decoded (into the live tensor when ``target`` gave one); ``target(index, items)``: a live
    CPU tensor to receive the whole chunk into, or None; ``deliver(items, tensor)``: hand the chunk
    to the planner; ``chunk_of(index)``: its sizes and dtype; ``items``: this rank's read items by
    stored chunk. A batch (several chunks in one exchange) travels as one buffer, each chunk at an
    offset both ends work out from the manifest (:func:`_layout`). ``error``: this rank already
    failed (before its walk): it only releases its peers, then raises that."""
    local = dict(read=read, target=target, deliver=deliver, chunk_of=chunk_of, items=items, stats=stats)
    for op in shares.ops:
        walk = _send if op.reader == exchange.rank else _receive
        error = walk(op, exchange, error, **local)
    if error is not None:
        raise _failure(error, exchange.rank, "shared chunks")


def _send(op, exchange: Exchange, error, *, read, deliver, chunk_of, items, stats, **_) -> BaseException | None:
    """This rank's turn as ``op``'s reader: read, send (a failed status once it failed), deliver its
    own share; its first error (``error`` if it came in with one)."""
    what = op.indices[0].fqn
    raw, header, tensors = None, torch.tensor([_FAILED, 0, 0], dtype=torch.int64), []
    if error is None:
        try:
            layout, nbytes = _layout(op.indices, chunk_of)
            tensors = [read(index, items[index]) for index in op.indices]
            raw = _pack(tensors, layout, nbytes)
            header = torch.tensor([_OK, _digest(raw), nbytes], dtype=torch.int64)
        except Exception as exc:
            error, raw = _failure(exc, exchange.rank, what), None
    try:
        exchange.send(op.receivers, header, raw, f"{what} was sent to it")
    except PeerLostError as exc:
        error = error or exc
    if raw is None:
        return error
    stats.bytes_sent += raw.numel() * len(op.receivers)
    try:
        for index, tensor in zip(op.indices, tensors):
            deliver(items[index], tensor)
    except Exception as exc:
        error = error or _failure(exc, exchange.rank, what)
    return error


def _receive(op, exchange: Exchange, error, *, target, deliver, chunk_of, items, stats, **_) -> BaseException | None:
    """This rank's turn as one of ``op``'s receivers: take everything the reader sends (drained once
    this rank failed), check it, deliver it; its first error."""
    what = op.indices[0].fqn
    if op.reader in exchange.lost:  # gone: it sends nothing more (its loss is this rank's error)
        return error
    try:
        status, digest, nbytes = exchange.receive_header(op.reader, f"it was to send {what}").tolist()
    except PeerLostError as exc:
        return error or exc
    if status != _OK:
        return error or PeerReadFailed(f"rank {op.reader} could not read {what} for this rank "
                                       "(its own error says why)")
    into = raw = None
    if error is None:
        try:
            layout, expected = _layout(op.indices, chunk_of)
            if nbytes != expected:
                raise CorruptCheckpointError(f"{what}: rank {op.reader} sends {nbytes} bytes where the "
                                             f"manifest has {expected}", tensor=what)
            into = target(op.indices[0], items[op.indices[0]]) if len(op.indices) == 1 else None
            raw = as_bytes(into) if into is not None else exchange.buffer(nbytes)
        except Exception as exc:
            error, into, raw = _failure(exc, exchange.rank, what), None, None
    try:  # taken even after a failure: the reader is sending it
        if raw is None:
            exchange.drain(op.reader, max(nbytes, 0), f"it was sending {what}")
        else:
            exchange.receive_into(op.reader, raw, f"it was sending {what}")
    except PeerLostError as exc:
        return error or exc
    except Exception as exc:  # not even scratch for it: nothing more this rank can do for the reader
        return error or _failure(exc, exchange.rank, what)
    stats.bytes_received += nbytes
    stats.chunks_received += len(op.indices)
    if error is not None:
        return error
    try:
        if _digest(raw) != digest:
            raise CorruptCheckpointError(f"{what}: the bytes received from rank {op.reader} differ "
                                         "from the bytes it read and verified", tensor=what)
        for index, (at, sizes, dtype) in zip(op.indices, layout):
            deliver(items[index], into if into is not None else _unpack(raw, at, sizes, dtype))
    except Exception as exc:
        error = _failure(exc, exchange.rank, what)
    return error


_ALIGN = 64  # each chunk of a batch starts at a multiple of this (any dtype's view of it is aligned)


def _layout(indices, chunk_of) -> tuple[list[tuple[int, tuple, torch.dtype]], int]:
    """Where each chunk of an exchange lies in its buffer (offset, sizes, dtype), and the buffer's
    bytes: one chunk alone fills it; a batch's chunks follow each other, aligned."""
    layout, at = [], 0
    for index in indices:
        sizes, dtype = chunk_of(index)
        at = -(-at // _ALIGN) * _ALIGN
        layout.append((at, tuple(sizes), dtype))
        at += math.prod(sizes) * dtype.itemsize
    return layout, at


def _pack(tensors: list[torch.Tensor], layout, nbytes: int) -> torch.Tensor:
    if len(tensors) == 1:
        return as_bytes(tensors[0])
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    for tensor, (at, _, _) in zip(tensors, layout):
        raw = as_bytes(tensor)
        buffer[at: at + raw.numel()].copy_(raw)
    return buffer


def _unpack(buffer: torch.Tensor, at: int, sizes: tuple, dtype: torch.dtype) -> torch.Tensor:
    return buffer[at: at + math.prod(sizes) * dtype.itemsize].view(dtype).reshape(sizes)


def serve_shared(plan, planner, open_source: Callable[[], Any], storage: dict, exchange: Exchange,
                 stats: LoadStats) -> list:
    """Take part in the exchange ``plan.storage_data`` assigns this rank (none without a
    :class:`RankShares`) over ``exchange`` and deliver what it brings; the plan's other items, for
    the reader's own storage path. ``open_source()``: the :class:`~ckpt.read.source.ChunkSource`
    to read from (a context manager); if opening it fails, this rank still walks its exchanges
    (failed: see the module docstring) before it raises."""
    shares = plan.storage_data
    if not isinstance(shares, RankShares) or not shares.ops:
        return list(plan.items)
    with ExitStack() as stack:
        failed, rest, items, source = None, [], {}, None
        try:
            mine = shares.indices()
            items = {index: [] for index in mine}
            for item in plan.items:
                (items[item.storage_index] if item.storage_index in mine else rest).append(item)
            source = stack.enter_context(open_source())
        except Exception as exc:
            failed = exc

        def chunk_of(index):
            return storage[index].sizes, source.manifest.tensors[index.fqn].dtype

        def target(index, wanted):
            return _whole_target(planner, wanted, storage[index], source.manifest.tensors[index.fqn].dtype)

        def read(index, wanted):
            chunk = storage[index]
            source.files.check(chunk.blob, what=index.fqn)
            source.files.check_table(chunk.blob, what=index.fqn)  # as every read: a cut file is refused whole
            into = target(index, wanted) if chunk.blob.codec == "raw" else None
            return next(iter(source.read_tensors([(None, index.fqn, chunk, into)])))[1]

        def deliver(wanted, tensor):
            _deliver(planner, wanted, tensor)

        exchange_shared(shares, exchange, read=read, target=target, deliver=deliver, chunk_of=chunk_of,
                        items=items, stats=stats, error=failed)
    return rest


def _whole_target(planner, wanted: list, chunk, dtype: torch.dtype) -> torch.Tensor | None:
    """The live tensor itself, when the one read item wants the whole chunk in its layout on CPU."""
    if len(wanted) != 1 or any(wanted[0].dest_offsets) or any(wanted[0].storage_offsets):
        return None
    target = planner.resolve_tensor(wanted[0])
    if (tuple(target.shape) != tuple(chunk.sizes) or target.device.type != "cpu" or target.dtype != dtype
            or not target.is_contiguous()):
        return None
    return target


def _deliver(planner, wanted: list, stored: torch.Tensor) -> None:
    for item in wanted:
        target = planner.resolve_tensor(item)
        if not (target.data_ptr() == stored.data_ptr() and target.shape == stored.shape):  # not read in place
            piece = stored
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                piece = piece.narrow(dim, start, length)
            target.copy_(piece)
        planner.commit_tensor(item, target)

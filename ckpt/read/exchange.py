"""Replicated bytes read once, the exchange: each rank walks its :class:`~ckpt.read.assignment.RankShares`
in the global order, reading and sending the chunks it was given, receiving the others.

Transport: point-to-point sends on the load's process group (``group_dst``/``group_src``: ranks of
that group), on the accelerator when the group's backend is an accelerator's (NCCL, HCCL: the
training backend's collectives), else on CPU (gloo). Per receiver, one exchange is a header
(status, digest) and, when the status is good, the chunk's decoded bytes — or a batch's: small
chunks (:data:`~ckpt.read.assignment.SMALL_BYTES`) travel together, one buffer per batch.

Verification: the reader verifies the stored bytes against the manifest as every read does
(:class:`~ckpt.read.source.ChunkSource`), decodes them, and only then takes the xxh3-64 of the very
buffer it sends; the receiver hashes what it received and refuses a mismatch
(:class:`~ckpt.errors.CorruptCheckpointError`). So the bytes a receiver uses are the bytes the
reader verified, whatever happened in between.

Failure: a rank that failed (its read, its check) keeps walking its exchanges so that no peer waits
forever: as a reader it sends a failed status (no data); as a receiver it still receives. It then
raises its first error; a receiver told of a peer's failure raises :class:`PeerReadFailed`, which
is no CheckpointError, so the caller unwrapping DCP's per-rank failures finds the reader's own. A
peer whose link fails (its process died: gloo's RuntimeError) is a
:class:`~ckpt.errors.PeerLostError` naming its rank; it is not addressed again, and the walk goes
on with the others (:attr:`Exchange.lost`, which ``ckpt.load`` raises when DCP's own collectives
then fail on the dead rank).

What a receiver takes into a live tensor before its hash is checked, and everything else a
failed load wrote, is put back by the load's rollback (:mod:`ckpt.read.rollback`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import xxhash

from .assignment import RankShares
from ..errors import CorruptCheckpointError, PeerLostError
from ..outcomes import LoadStats

_OK, _FAILED = 1, 0
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "hccl": "npu"}


class PeerReadFailed(RuntimeError):
    """Another rank could not read a chunk this rank was to receive from it."""


def _digest(raw: torch.Tensor) -> int:
    """xxh3-64 of a CPU uint8 tensor, as a signed 64-bit value (what an int64 header carries)."""
    value = xxhash.xxh3_64_intdigest(memoryview(raw.numpy()))
    return value - (1 << 64) if value >= 1 << 63 else value


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class Exchange:
    """Point-to-point sends of one load's process group (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        backend = str(dist.get_backend(group))
        device_type = next((d for b, d in _ACCELERATOR_BACKENDS.items() if b in backend), "cpu")
        if device_type == "cpu":
            self.device = torch.device("cpu")
        else:
            module = getattr(torch, device_type)
            self.device = torch.device(device_type, module.current_device())

        self.lost: dict[int, PeerLostError] = {}  # peers whose link failed, never addressed again

    def send(self, receivers: tuple[int, ...], header: torch.Tensor, raw: torch.Tensor | None, what: str) -> None:
        """Send to each receiver still reachable; raise the first :class:`PeerLostError` after the
        others got theirs."""
        tensors = [header] if raw is None else [header, raw]
        tensors = [t.to(self.device) for t in tensors]
        receivers = [r for r in receivers if r not in self.lost]
        works = {r: [self._talk(r, what, lambda t=t, r=r: dist.isend(t, group=self.group, group_dst=r))
                     for t in tensors] for r in receivers}
        failure = None
        for r, pending in works.items():
            try:
                for work in pending:
                    self._talk(r, what, work.wait)
            except PeerLostError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def receive_header(self, reader: int, what: str) -> torch.Tensor:
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._talk(reader, what, lambda: dist.recv(header, group=self.group, group_src=reader))
        return header.cpu()

    def receive_into(self, reader: int, raw: torch.Tensor, what: str) -> None:
        if self.device.type == "cpu":
            self._talk(reader, what, lambda: dist.recv(raw, group=self.group, group_src=reader))
            return
        staged = torch.empty(raw.shape, dtype=raw.dtype, device=self.device)
        self._talk(reader, what, lambda: dist.recv(staged, group=self.group, group_src=reader))
        raw.copy_(staged)

    def _talk(self, peer: int, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` (a send or receive with ``peer``), a backend failure (gloo's RuntimeError when
        the peer's process died: "Connection closed by peer") raised as :class:`PeerLostError`."""
        if peer in self.lost:
            raise self.lost[peer]
        try:
            return call()
        except RuntimeError as exc:
            self.lost[peer] = PeerLostError(f"rank {peer} of the load's process group stopped answering while "
                                            f"{what} ({type(exc).__name__}: {exc})", peer=peer, tensor=what)
            raise self.lost[peer] from exc


def exchange_shared(shares: RankShares, exchange: Exchange, *, read: Callable[[Any, list], torch.Tensor],
                    target: Callable[[Any, list], torch.Tensor | None], deliver: Callable[[list, torch.Tensor], None],
                    chunk_of: Callable[[Any], tuple[tuple, torch.dtype]], items: dict, stats: LoadStats) -> None:
    """Walk ``shares`` (see the module docstring). ``read(index, items)``: the stored chunk, verified
    and decoded (into the live tensor when ``target`` gave one); ``target(index, items)``: a live
    CPU tensor to receive the whole chunk into, or None; ``deliver(items, tensor)``: hand the chunk
    to the planner; ``chunk_of(index)``: its sizes and dtype; ``items``: this rank's read items by
    stored chunk. A batch (several chunks in one exchange) travels as one buffer, each chunk at an
    offset both ends work out from the manifest (:func:`_layout`)."""
    error: BaseException | None = None
    for op in shares.ops:
        layout, nbytes = _layout(op.indices, chunk_of)
        what = op.indices[0].fqn
        if op.reader == exchange.rank:
            raw, header, tensors = None, torch.tensor([_FAILED, 0], dtype=torch.int64), []
            if error is None:
                try:
                    tensors = [read(index, items[index]) for index in op.indices]
                    raw = _pack(tensors, layout, nbytes)
                    header = torch.tensor([_OK, _digest(raw)], dtype=torch.int64)
                except Exception as exc:
                    error, raw = exc, None
            try:
                exchange.send(op.receivers, header, raw, f"{what} was sent to it")
            except PeerLostError as exc:
                error = error or exc
            if raw is not None:
                stats.bytes_sent += nbytes * len(op.receivers)
                try:
                    for index, tensor in zip(op.indices, tensors):
                        deliver(items[index], tensor)
                except Exception as exc:
                    error = error or exc
            continue
        if op.reader in exchange.lost:  # gone: it sends nothing more (its loss is this rank's error)
            continue
        try:
            status, digest = exchange.receive_header(op.reader, f"it was to send {what}").tolist()
        except PeerLostError as exc:
            error = error or exc
            continue
        if status != _OK:
            error = error or PeerReadFailed(f"rank {op.reader} could not read {what} for this rank "
                                            "(its own error says why)")
            continue
        into = None
        if error is None and len(op.indices) == 1:
            try:
                into = target(op.indices[0], items[op.indices[0]])
            except Exception as exc:
                error = exc
        raw = _as_bytes(into) if into is not None else torch.empty(nbytes, dtype=torch.uint8)
        try:  # received even after a failure: the reader is sending it
            exchange.receive_into(op.reader, raw, f"it was sending {what}")
        except PeerLostError as exc:
            error = error or exc
            continue
        stats.bytes_received += nbytes
        stats.chunks_received += len(op.indices)
        if error is not None:
            continue
        try:
            if _digest(raw) != digest:
                raise CorruptCheckpointError(f"{what}: the bytes received from rank {op.reader} differ "
                                             "from the bytes it read and verified", tensor=what)
            for index, (at, sizes, dtype) in zip(op.indices, layout):
                piece = into if into is not None else _unpack(raw, at, sizes, dtype)
                deliver(items[index], piece)
        except Exception as exc:
            error = exc
    if error is not None:
        raise error


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
        return _as_bytes(tensors[0])
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    for tensor, (at, _, _) in zip(tensors, layout):
        raw = _as_bytes(tensor)
        buffer[at: at + raw.numel()].copy_(raw)
    return buffer


def _unpack(buffer: torch.Tensor, at: int, sizes: tuple, dtype: torch.dtype) -> torch.Tensor:
    return buffer[at: at + math.prod(sizes) * dtype.itemsize].view(dtype).reshape(sizes)


def serve_shared(plan, planner, source, storage: dict, exchange: Exchange, stats: LoadStats) -> list:
    """Take part in the exchange ``plan.storage_data`` assigns this rank (none without a
    :class:`RankShares`) over ``exchange`` and deliver what it brings; the plan's other items, for
    the reader's own storage path."""
    shares = plan.storage_data
    if not isinstance(shares, RankShares) or not shares.ops:
        return list(plan.items)
    mine = shares.indices()
    items: dict = {index: [] for index in mine}
    rest = []
    for item in plan.items:
        (items[item.storage_index] if item.storage_index in mine else rest).append(item)
    manifest = source.manifest

    def chunk_of(index):
        return storage[index].sizes, manifest.tensors[index.fqn].dtype

    def target(index, wanted):
        return _whole_target(planner, wanted, storage[index], manifest.tensors[index.fqn].dtype)

    def read(index, wanted):
        chunk = storage[index]
        source.files.check(chunk.blob, what=index.fqn)
        source.files.check_table(chunk.blob, what=index.fqn)  # as every read: a cut file is refused whole
        into = target(index, wanted) if chunk.blob.codec == "raw" else None
        return next(iter(source.read_tensors([(None, index.fqn, chunk, into)])))[1]

    def deliver(wanted, tensor):
        _deliver(planner, wanted, tensor)

    exchange_shared(shares, exchange, read=read, target=target, deliver=deliver, chunk_of=chunk_of,
                    items=items, stats=stats)
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

"""Point-to-point messages between the ranks of one load's process group, in host memory: the
channel of the shared-read exchange (:mod:`ckpt.read.exchange`) and of partner copies
(:mod:`ckpt.memory.partner`).

Messages are CPU tensors sent on :func:`ckpt.collective.host_group` of the group: the group itself
when it is gloo or has a ``cpu:gloo`` side, else a gloo group over the same ranks, in the same order,
made once for it (so ``group_dst``/``group_src`` are ranks of the given group, and no message goes
through a device or an accelerator's communicator). A payload travels in messages of at most
:data:`PIECE_BYTES`, cut alike at both ends, so that a receiver with no buffer for it can still take
it all (:meth:`Exchange.drain`) and release its sender. A peer whose link fails (its process died:
gloo's RuntimeError) is a :class:`~ckpt.errors.PeerLostError` naming its rank, and is not addressed
again (:attr:`Exchange.lost`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..collective import host_group
from ..errors import PeerLostError

PIECE_BYTES = 16 << 20  # one message of a payload, at most (and a draining receiver's scratch)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _spans(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each message ``nbytes`` travel in: both ends cut them alike (an empty
    payload is one empty message)."""
    return [(at, min(PIECE_BYTES, nbytes - at)) for at in range(0, nbytes, PIECE_BYTES)] or [(0, 0)]


def _pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    if not tensor.is_contiguous():
        raise ValueError("the channel sends and receives contiguous tensors only")
    if tensor.numel() * tensor.dtype.itemsize <= PIECE_BYTES:  # one message, as it is
        return [tensor]
    raw = as_bytes(tensor)
    return [raw[at: at + n] for at, n in _spans(raw.numel())]


class Exchange:
    """Point-to-point sends between the ranks of one load's process group, in host memory (see the
    module docstring). Collective to make: every rank of ``group`` makes one at the same point."""

    def __init__(self, group: dist.ProcessGroup):
        self.rank = dist.get_rank(group)
        self.group = host_group(group)  # same ranks, same order
        self.lost: dict[int, PeerLostError] = {}  # peers whose link failed, never addressed again

    def send(self, receivers: tuple[int, ...], header: torch.Tensor, raw: torch.Tensor | None, what: str) -> None:
        """Send ``header`` and ``raw`` (CPU tensors) to each receiver still reachable; raise the first
        :class:`PeerLostError` after the others got theirs."""
        tensors = _pieces(header) + ([] if raw is None else _pieces(raw))
        receivers = [r for r in receivers if r not in self.lost]
        works: dict[int, list] = {}
        for r in receivers:
            try:
                works[r] = [self._talk(r, what, lambda t=t, r=r: dist.isend(t, group=self.group, group_dst=r))
                            for t in tensors]
            except PeerLostError:
                works[r] = []
        failure = next((self.lost[r] for r in receivers if r in self.lost), None)
        for r, pending in works.items():
            try:
                for work in pending:
                    self._talk(r, what, work.wait)
            except PeerLostError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def receive_header(self, reader: int, what: str) -> torch.Tensor:
        header = torch.zeros(3, dtype=torch.int64)
        self.receive_into(reader, header, what)
        return header

    def receive_into(self, reader: int, raw: torch.Tensor, what: str) -> None:
        """Receive into ``raw`` (a contiguous CPU tensor) what ``reader`` sent with :meth:`send`."""
        works = [self._talk(reader, what, lambda p=p: dist.irecv(p, group=self.group, group_src=reader))
                 for p in _pieces(raw)]
        for work in works:
            self._talk(reader, what, work.wait)

    def drain(self, reader: int, nbytes: int, what: str) -> None:
        """Take and drop the ``nbytes`` ``reader`` sends, into one piece of scratch (a receiver with
        no buffer of its own for them: the reader is sending them all the same)."""
        scratch = torch.empty(min(nbytes, PIECE_BYTES), dtype=torch.uint8)
        for _, n in _spans(nbytes):
            self._talk(reader, what, lambda n=n: dist.recv(scratch[:n], group=self.group, group_src=reader))

    def buffer(self, nbytes: int) -> torch.Tensor:
        """Host memory to receive ``nbytes`` into (allocating may fail: the caller drains then)."""
        return torch.empty(nbytes, dtype=torch.uint8)

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

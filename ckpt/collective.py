"""Agreement between ranks: one rank's value or error on every rank, and "does any rank say yes?".

Errors cross ranks as objects (``broadcast_object_list`` pickles them), so every rank raises the
same type with the same attributes (``CorruptCheckpointError.file``,
``IncompatibleCheckpointError.missing``, ...). Only errors raised by our own ranks are ever
unpickled; one that cannot be pickled travels as a :class:`~ckpt.errors.CheckpointError` carrying
its type name and message. Without a process group every function is the local identity.

Host memory between ranks (:func:`host_group`): point-to-point sends of CPU tensors on the group a
load was given when CPU tensors sent on it travel through gloo (a gloo group, or a mixed group's
``cpu:gloo`` side: :func:`host_side`), else on a gloo group over the same ranks, in the same order,
made once per group and process (collectively: every rank of the group asks at the same point) and
kept while the group lives. So bytes exchanged between ranks never go through device memory, and no
accelerator communicator is made for them.
"""

from __future__ import annotations

import pickle
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from .errors import CheckpointError


def _portable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return CheckpointError(f"{type(error).__name__}: {error}")
    return error


def broadcast_value(value, group: dist.ProcessGroup | None, *, src: int = 0, distributed: bool = True):
    """Rank ``src``'s ``value`` (any picklable object of our own making) on every rank of ``group``
    (``src``: rank within it)."""
    if not distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, group_src=src, group=group)
    return box[0]


def broadcast_error(error: BaseException | None, group: dist.ProcessGroup | None, *, src: int = 0,
                    distributed: bool = True) -> BaseException | None:
    """Rank ``src``'s ``error`` (or None) on every rank of ``group`` (``src``: rank within it)."""
    if not distributed:
        return error
    return broadcast_value(_portable(error), group, src=src)


def run_on_src(fn: Callable[[], None], group: dist.ProcessGroup | None, *, distributed: bool) -> None:
    """Call ``fn`` (every rank calls this; ``fn`` may fail on rank 0 of ``group`` only, e.g. file
    system work done there) and raise rank 0's error, if any, on every rank."""
    local = None
    try:
        fn()
    except Exception as exc:
        local = exc
    agreed = broadcast_error(local, group, distributed=distributed)
    if local is not None:
        raise local
    if agreed is not None:
        raise agreed


def any_rank(flags: tuple[bool, ...], group: dist.ProcessGroup | None, *, distributed: bool) -> tuple[bool, ...]:
    """For each flag: true on every rank when it is true on at least one rank of ``group`` (one
    all-reduce for all of them)."""
    if not distributed:
        return tuple(bool(f) for f in flags)
    tensor = torch.tensor([int(bool(f)) for f in flags])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tuple(bool(v) for v in tensor.tolist())


class Agreement:
    """One decision on every rank of ``group`` (a gloo group; None with ``distributed=False``: every
    method is then the local answer): rank 0 decides and the others take its answer
    (:meth:`decided`), a flag is up when any rank raises it (:meth:`any`), the first rank's error
    stands for all (:meth:`first_error`). Every rank calls each method at the same point."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, distributed: bool = False):
        self.group, self.distributed = group, distributed
        self.rank = dist.get_rank(group) if distributed else 0

    def decided(self, fn: Callable[[], object]):
        """``fn()`` on rank 0 (the only rank that calls it), its value on every rank; its error
        raised on every rank."""
        value, error = None, None
        if self.rank == 0:
            try:
                value = fn()
            except Exception as exc:
                error = exc
        value, error = broadcast_value((value, _portable(error)), self.group, distributed=self.distributed)
        if error is not None:
            raise error
        return value

    def any(self, flag: bool) -> bool:
        return any_rank((flag,), self.group, distributed=self.distributed)[0]

    def each(self, fn: Callable[[], object]):
        """``fn()`` on every rank; its value, or the first failing rank's error raised on every rank
        (a CheckpointError or OSError; anything else is raised where it happened, unshared)."""
        value, error = None, None
        try:
            value = fn()
        except (CheckpointError, OSError) as exc:
            error = exc
        error = self.first_error(error)
        if error is not None:
            raise error
        return value

    def first_error(self, error: BaseException | None) -> BaseException | None:
        """The error of the lowest rank that has one (this rank's own object where it is that
        rank), or None on every rank when none has."""
        if not self.distributed:
            return error
        errors: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, _portable(error), group=self.group)
        for rank, found in enumerate(errors):
            if found is not None:
                return error if rank == self.rank else found
        return None


LOCAL = Agreement()


_HOST_GROUPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup]" = weakref.WeakKeyDictionary()


def host_side(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` (None: the default group) when CPU tensors sent on it travel through gloo, else None
    (an NCCL or HCCL group without a ``cpu:gloo`` side)."""
    group = group or dist.group.WORLD
    config = str(dist.get_backend_config(group))  # "cpu:gloo,cuda:nccl"; a bare name serves every device
    for part in config.split(","):
        device, _, backend = part.strip().rpartition(":")
        if device in ("", "cpu"):
            return group if backend.lower() == "gloo" else None
    return None


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The group on which ranks of ``group`` send each other CPU tensors (see the module docstring):
    ranks and their order are ``group``'s. Collective on first use for a group without a host side."""
    group = group or dist.group.WORLD
    side = host_side(group)
    if side is not None:
        return side
    made = _HOST_GROUPS.get(group)
    if made is None:
        ranks = sorted(dist.get_process_group_ranks(group), key=lambda r: dist.get_group_rank(group, r))
        # a group of every rank: made by all; a smaller one: by its own ranks alone (the others are
        # not in this load and never ask). Ranks in another order than the global one need
        # sort_ranks, which only recent torch has.
        order = {} if ranks == sorted(ranks) else {"sort_ranks": False}
        made = dist.new_group(ranks=ranks, backend="gloo", group_desc="ckpt_host", **order,
                              use_local_synchronization=len(ranks) < dist.get_world_size())
        _HOST_GROUPS[group] = made
    return made

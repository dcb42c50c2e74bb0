"""Agreement between ranks: one rank's value or error on every rank, and "does any rank say yes?".

Errors cross ranks as objects (``broadcast_object_list`` pickles them), so every rank raises the
same type with the same attributes (``CorruptCheckpointError.file``,
``IncompatibleCheckpointError.missing``, ...). Only errors raised by our own ranks are ever
unpickled; one that cannot be pickled travels as a :class:`~ckpt.errors.CheckpointError` carrying
its type name and message. Without a process group every function is the local identity.
"""

from __future__ import annotations

import pickle
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

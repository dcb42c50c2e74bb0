"""MemoryGate: whether every rank takes the next memory-only save, agreed a step ahead without blocking.

    gate = MemoryGate(group)           # every rank; group: a gloo group the training thread owns
    if gate.open():                    # the decision posted at the last save, the same on every rank
        ... snapshot, queue the write ...
    gate.post(stager.has_free_set())   # after each save call that may snapshot: every rank, same order

``memory_interval`` 1 means every step whose previous memory save has finished: a step whose
snapshot would have to wait for a buffer set (the writer still busy with earlier saves) is skipped,
on every rank alike, since the memory tier's save is collective on the writer thread. Agreeing on
that with a blocking collective would put a collective in every training step; instead each save
call posts, as a non-blocking all-reduce (MIN), whether this rank has a free buffer set now, and the
next save call reads that result: ready by then (every rank posted it a step ago), so the training
thread does not wait. Between a post and the next save call no snapshot is taken, so a set free at
the post is still free: an open gate never blocks in the snapshot. The first call is open.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class MemoryGate:
    """See the module docstring. ``group`` None: this process alone (the local flag, a step later)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._flag: torch.Tensor | None = None  # the last post's value (its all-reduce's result once waited)
        self._work = None  # the all-reduce in flight, if any

    def open(self) -> bool:
        """Whether every rank had a free buffer set at the last post (True before the first)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._flag is None or bool(self._flag.item())

    def post(self, free: bool) -> None:
        """Tell the next :meth:`open`, on every rank, whether this rank has a free buffer set now."""
        self.open()  # one in flight at a time (a post without an open between: the earlier one first)
        self._flag = torch.tensor([int(bool(free))], dtype=torch.int32)
        if self.group is not None:
            self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True)

    def close(self) -> None:
        """Wait for the post in flight (before its group is destroyed)."""
        self.open()

"""Double-buffered staging: snapshot the training state into reusable host buffers, off the hot path.

``DoubleBufferStager`` implements DCP's ``AsyncStager``. Each ``stage(state_dict)`` takes a free buffer
set (two at most, allocated lazily at first use, reallocated only when the state's layout changes,
pinned by the device's host allocator where it has one: :mod:`ckpt.write.host_buffers`,
:func:`ckpt.device.host_memory`), captures every non-tensor value synchronously (a deep copy; an
immutable scalar, or a tuple of them, is its own copy, as ``copy.deepcopy`` returns it too), and
starts copying the tensors (a DTensor's local shard) into the set (:mod:`ckpt.write.snapshot_copy`:
device tensors on a side stream of their device, host tensors on a copier thread). The staged tree
holds the host views; a DTensor is re-wrapped around its host view with its own spec, never moved
back to the mesh's device.

It returns a ``Future`` of the staged state dict at once. The caller must not change the state until
:meth:`DoubleBufferStager.wait_snapshot` (the manager calls it from an optimizer step pre-hook and,
for modules with persistent buffers, a forward pre-hook; on an accelerator it only makes the compute
stream wait on the copy's event, the host blocks only for host-memory sources).

A buffer set stays busy until the write that reads it is done: :meth:`track` a write's future to
release it then (the manager does). An untracked set is free again at the next-but-one ``stage``,
which is DCP's own contract (wait for one ``async_save`` before starting another). When every set
is busy, ``policy="block"`` waits for the oldest write and ``policy="skip"`` raises
:class:`SnapshotSkipped` (counted in ``skipped``).

Host memory goes back in two steps, references first. A layout change drops every reference the
stager holds to the old memory (the set, its views, a finished snapshot's result), and those of a
free set of an old layout, before the new set is allocated: the caching host allocator reuses the
freed blocks, and nothing is handed to the system on the training thread inside ``stage()``.
:meth:`DoubleBufferStager.close` drops them all, then gives the cached blocks back to the system
(``cudaFreeHost``/``aclrtFreeHost``); a staged state dict the caller still holds keeps its set.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ..device import accelerator_module, host_memory
from ..errors import SnapshotSkipped
from .host_buffers import HostBuffers, signature
from ..options import BusyPolicy, as_enum
from .snapshot_copy import SnapshotCopy
from ..tree import HOLE, Skeleton, copy_tree
from ..format.values import Leaf

_HELD = Future()  # marks a set kept as a base until the next track(): earlier writes must not free it


@dataclass
class _BufferSet:
    index: int
    memory: HostBuffers | None = None
    writer: Future | None = None  # the write reading this set, when tracked
    busy: bool = False
    views: list[torch.Tensor] = field(default_factory=list)
    wrapped: list[DTensor | None] = field(default_factory=list)  # the DTensor staged around each view last time

    @property
    def nbytes(self) -> int:
        return 0 if self.memory is None else self.memory.nbytes


class DoubleBufferStager(AsyncStager):
    """AsyncStager with two reusable host buffer sets (see the module docstring).

    Args:
        device_type: "cuda", "npu" or "cpu"; default: the accelerator in use, else cpu.
        policy: :class:`~ckpt.options.BusyPolicy` (or its string): block (default) or skip when
            both buffer sets are busy.
        pin_memory: pin the host buffers (default: True on an accelerator).
    """

    _synchronize_after_execute = False
    copy_engine = SnapshotCopy  # how bytes move (a stand-in accelerator's tests replace it)

    def __init__(self, device_type: str | None = None, *, policy: BusyPolicy | str = BusyPolicy.BLOCK,
                 pin_memory: bool | None = None):
        self.policy = as_enum(BusyPolicy, policy, "policy")
        self.accel = accelerator_module(device_type)
        self.device_type = device_type or ("cpu" if self.accel is None else self.accel.__name__.split(".")[-1])
        self.pin_memory = (self.accel is not None) if pin_memory is None else pin_memory
        self.host_memory = host_memory(self.device_type, self.pin_memory)  # where the buffer sets come from
        self.sets = [_BufferSet(0), _BufferSet(1)]
        self.skipped = 0
        self._lock = threading.Condition()
        self._last: _BufferSet | None = None  # the set most recently staged into
        self._held: _BufferSet | None = None  # kept unchanged as the base of the next write
        self._copy = self.copy_engine(self.accel)  # streams and the copier thread are made at first use
        self._closed = False

    # -- AsyncStager ---------------------------------------------------------------------------
    def stage(self, state_dict: dict, *, keep_previous: bool = False, release: Future | None = None,
              signature: tuple | None = None) -> Future:
        """Start a snapshot of ``state_dict``; returns a Future of the staged copy.

        ``keep_previous``: the set staged last is not overwritten and stays busy until the next
        :meth:`track`'ed write completes (a delta checkpoint reads it as its base). ``release``: the
        write that will read this snapshot, when the caller knows it now (as :meth:`track` after).
        ``signature``: the state's :func:`~ckpt.write.delta.tensor_signature`, when the caller has it."""
        if self._closed:
            raise RuntimeError("stager is closed")
        self.wait_snapshot()  # one snapshot at a time: the previous copy must be complete
        previous = self._last if keep_previous else None
        target = self._acquire(exclude=previous)
        self._held = previous
        sources: list[torch.Tensor] = []
        likes: list[torch.Tensor] = []
        skeleton = _capture(state_dict, sources, likes)
        self._ensure_buffers(target, sources, signature)
        staged = skeleton.fill(_staged(target, likes))
        self._last = target
        snapshot = self._copy.start(list(zip(sources, target.views)), staged)
        if release is not None:
            self.track(release)
        return snapshot

    def synchronize_staging(self) -> None:
        self.wait_snapshot()

    def close(self) -> None:
        """Wait for the snapshot in flight, drop every reference to both buffer sets, then hand the
        allocator's cached blocks back to the system (a block still referenced stays)."""
        if self._closed:
            return
        self._copy.close()
        with self._lock:
            for buffers in self.sets:
                _drop(buffers)
            self._last = self._held = None
        self._closed = True
        self.host_memory.give_back()

    # -- the manager's hooks -------------------------------------------------------------------
    def wait_snapshot(self, host: bool = False) -> None:
        """Make it safe to modify the staged state: the snapshot copy must be complete.

        Host-memory sources are waited for on the host. Device sources only order the compute
        stream after the copies (no host wait) unless ``host=True``; the copy stays pending for a
        later host wait (``close`` frees the buffers only after one)."""
        self._copy.wait(host=host)

    @property
    def device_stall_s(self) -> float:
        """Seconds compute streams have waited for snapshot copies (0 on CPU)."""
        return self._copy.device_stall_s()

    def track(self, write: Future) -> None:
        """Release the set staged last (and a set kept as its base) when ``write`` completes."""
        sets = [b for b in (self._last, self._held) if b is not None]
        self._held = None
        with self._lock:
            for buffers in sets:  # busy again if a write of the same snapshot already ended and freed it
                buffers.busy, buffers.writer = True, write
        write.add_done_callback(lambda done: [self._release(b, done) for b in sets])

    def has_free_set(self) -> bool:
        """Whether a ``stage`` now would find a free buffer set without waiting."""
        with self._lock:
            return any(not b.busy or (b.writer is None and b is not self._last) for b in self.sets)

    @property
    def host_bytes(self) -> int:
        """Host memory held by the buffer sets, as the (pinned) allocator reserves it."""
        return sum(b.nbytes for b in self.sets)

    # -- internals -----------------------------------------------------------------------------
    def _release(self, buffers: _BufferSet, write: Future) -> None:
        with self._lock:
            if buffers.writer is not write:  # since claimed by a later write (held as its base)
                return
            buffers.busy, buffers.writer = False, None
            self._lock.notify_all()

    def _acquire(self, exclude: _BufferSet | None = None) -> _BufferSet:
        with self._lock:
            for buffers in self.sets:  # an untracked set is free once another set has been staged
                if buffers.busy and buffers.writer is None and buffers is not self._last:
                    buffers.busy = False
            if exclude is not None:  # held as a base: only the next tracked write may release it
                exclude.busy, exclude.writer = True, _HELD
            while True:
                free = [b for b in self.sets if not b.busy]
                # Prefer a set that already has buffers, so a second set is allocated only if needed.
                free.sort(key=lambda b: b.memory is None)
                if free:
                    free[0].busy = True
                    return free[0]
                if self.policy is BusyPolicy.SKIP:
                    self.skipped += 1
                    raise SnapshotSkipped("both staging buffer sets are still being written; save skipped")
                self._lock.wait()

    def _ensure_buffers(self, buffers: _BufferSet, sources: list[torch.Tensor], layout: tuple | None) -> None:
        wanted = layout or signature(sources)
        if buffers.memory is not None and buffers.memory.signature == wanted:
            return
        # Every reference to memory of another layout goes before the new set is allocated, so that
        # the allocator can reuse its blocks: this set's, a free set's, a finished snapshot's result.
        self._copy.forget_completed()
        with self._lock:
            for other in self.sets:
                stale = other.memory is not None and other.memory.signature != wanted
                if other is buffers or (stale and not other.busy):
                    _drop(other)
        buffers.memory = HostBuffers(sources, self.host_memory)
        buffers.views = buffers.memory.views
        buffers.wrapped = [None] * len(buffers.views)


def _drop(buffers: _BufferSet) -> None:
    """Forget a set's memory (it is freed once no staged state dict holds a view of it)."""
    buffers.memory, buffers.views, buffers.wrapped = None, [], []


_ATOMIC = frozenset({int, float, bool, complex, str, bytes, type(None)})


def _copied(value: Any) -> Any:
    """``copy.deepcopy(value)``, without its cost where it returns ``value`` itself."""
    kind = type(value)
    if kind in _ATOMIC or (kind is tuple and all(type(item) in _ATOMIC for item in value)):
        return value
    return copy.deepcopy(value)


def _capture(state_dict: Any, sources: list[torch.Tensor], likes: list[torch.Tensor]) -> Skeleton:
    """Copy the structure and every non-tensor value now; note each tensor (``likes``) and what is
    copied of it later (``sources``: the local shard of a DTensor), its place a hole of the skeleton."""

    def leaf(node: Any) -> Any:
        if type(node) in _ATOMIC:  # most values: the optimizer's hyper-parameters
            return node
        if isinstance(node, torch.Tensor):
            sources.append((node.to_local() if isinstance(node, DTensor) else node).detach())
            likes.append(node)
            return HOLE
        if isinstance(node, Leaf):
            return Leaf(_copied(node.value))
        return _copied(node)

    with torch.no_grad():  # a DTensor's to_local() is then its local tensor, not an autograd op's output
        return copy_tree(state_dict, leaf)


def _staged(buffers: _BufferSet, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """The staged value of each tensor of ``likes``: its host view in ``buffers``; for a DTensor, a
    DTensor around that view with the live one's spec — the one made at this set's last snapshot when
    the spec is the same object (a wrapper holds nothing but the view and the spec; making one costs
    more than the rest of its staging).

    ``DTensor.from_local`` would move the view to the mesh's device (``local_tensor.to(device_type)``):
    on a GPU/NPU mesh the checkpoint would be written from a device copy of a buffer the snapshot has
    not filled yet, and a second copy of the state would sit on the device. DCP's own CPU state dicts
    do the same."""
    staged: list[torch.Tensor] = []
    for i, (view, like) in enumerate(zip(buffers.views, likes)):
        if isinstance(like, DTensor):
            wrapped = buffers.wrapped[i]
            if wrapped is None or wrapped._spec is not like._spec:
                wrapped = buffers.wrapped[i] = DTensor(view, like._spec, requires_grad=False)
            view = wrapped
        staged.append(view)
    return staged

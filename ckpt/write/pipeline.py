"""SavePipeline: the one asynchronous save path. :class:`~ckpt.manager.CheckpointManager` and every
path-based plug-in (:mod:`ckpt.integrations`) hand their saves to it; a fix here reaches them all.

    pipeline = SavePipeline(options)          # SaveOptions: async_mode, policy, on_error, full_every, ...
    pipeline.attach(optimizer, model=model)   # or attach_everywhere(), for a plug-in
    pipeline.save(Target(key, step, write, folder=..., name=...), tree)   # returns once snapshotted
    pipeline.wait(); pipeline.close()

The caller says *where* (a :class:`Target`: the key naming the destination, its step, the folder and
name by which a delta beside it names it as its base, and the function that writes and commits a tree
there: the manager's also replicates and applies retention). The pipeline does the rest, for every caller:

1. ``save`` (training thread): one agreement among the ranks (``agree``: did an earlier save fail,
   are both buffer sets busy under ``policy="skip"``, may this save be a delta
   (:mod:`ckpt.write.delta`), is it the last snapshot's state again); an earlier failure is raised
   (``on_error="stop"``) or warned about and counted (``continue``); the snapshot into a free staging
   buffer set (:mod:`ckpt.write.staging`), or the last snapshot again when this save is the same
   state to a second destination (Lightning's ``last.ckpt``); the write is queued. A memory-only
   save (the memory tier's step between storage saves, with staging) takes no agreement: the
   tier's gate (:class:`~ckpt.memory.MemoryGate`) decided a step ahead, without blocking, whether
   every rank has a free buffer set; if not, the step is skipped, never waited for.
2. the writer thread (one, single-threaded ATen): wait for the snapshot (and the delta base's),
   call the target's ``write``.
3. the end of a write records a failure for the training thread; the snapshot's buffer set is free
   again once every write reading it has ended.

Every destination of a save is written from ``_persist`` on the writer thread: the memory tier
(``memory``, a :class:`~ckpt.memory.MemoryTier`, when a caller sets one) first, then the target's
own write; a memory-tier failure is counted and said, never raised.

Before the live state changes, the snapshot copy must be complete: :meth:`attach` and
:meth:`attach_everywhere` hook the optimizers' steps and modules' forwards
(:class:`~ckpt.write.hooks.SnapshotHooks`). ``async_mode="sync"`` writes inside ``save``.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from ..options import AsyncMode, BusyPolicy, SaveOptions
from ..outcomes import BackgroundFailures, SavesInFlight, SaveStats
from .delta import DeltaBase, DeltaChain, tensor_signature
from .hooks import SnapshotHooks
from .snapshot_copy import single_threaded_aten
from .staging import DoubleBufferStager

Agree = Callable[[tuple[bool, ...]], tuple[bool, ...]]


@dataclass(frozen=True)
class Target:
    """Where one save goes. ``key``: the destination (the manager's step, a plug-in's path);
    ``write(tree, base)``: on the writer thread, write and commit ``tree`` there (a delta on ``base``,
    a :class:`~ckpt.write.DeltaBase`, when given; None: the memory tier only); a delta builds only on
    another target in the same ``folder`` at another ``step``, recorded by its ``name`` (None: never a
    base); ``memory``: the pipeline's memory tier (:mod:`ckpt.memory`) keeps this step too."""

    key: Hashable
    step: int | None
    write: Callable[[Any, DeltaBase | None], None] | None
    folder: str = ""
    name: str | None = None
    memory: bool = False

    def __str__(self) -> str:
        return f"step {self.step}" if self.key == self.step else str(self.key)


@dataclass(frozen=True)
class Started:
    """A save the pipeline took on; ``base``: the key of the save it is a delta of (None: stored whole)."""

    base: Hashable | None = None


class _Readers:
    """The writes reading one snapshot's buffer set: ``released`` (handed to the stager) resolves when
    the last of them ends; a second destination may join only while one is still reading."""

    def __init__(self) -> None:
        self.released: Future = Future()
        self._count = 1
        self._lock = threading.Lock()

    def join(self) -> bool:
        with self._lock:
            if self._count:
                self._count += 1
            return bool(self._count)

    def leave(self) -> None:
        with self._lock:
            self._count -= 1
            last = not self._count
        if last:
            self.released.set_result(None)


class SavePipeline:
    """See the module docstring. ``agree``: each flag true on every rank when true on any (default:
    this process alone); ``stats``: the counters to add to (a plug-in's, kept across pipelines)."""

    def __init__(self, options: SaveOptions, *, agree: Agree | None = None, stats: SaveStats | None = None):
        self.options = options
        self._agree = agree or (lambda flags: flags)
        self._stats = stats if stats is not None else SaveStats()
        self.stager = (DoubleBufferStager(options.device_type, policy=options.policy)
                       if options.async_mode is AsyncMode.DOUBLE_BUFFER else None)
        self.deltas = DeltaChain(options.full_every)
        self.inflight = SavesInFlight()  # key -> the future of its write
        self.failures = BackgroundFailures(options.on_error)
        self._hooks = SnapshotHooks(lambda: self.before_step())  # looked up when a hook fires, as before
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist", initializer=single_threaded_aten)
        self._readers: _Readers | None = None  # of the last snapshot
        self.memory = None  # a ckpt.memory.MemoryTier (use_memory), on every rank alike
        self._gate = None  # its ckpt.memory.MemoryGate: memory-only saves without a blocking collective

    @property
    def stats(self) -> SaveStats:
        """The counters, with the device stall measured so far added in."""
        if self.stager is not None:
            self._stats.host_buffer_bytes = self.stager.host_bytes
            device = self.stager.device_stall_s
            new, self._stats.device_stall_s = device - self._stats.device_stall_s, device
            self._stats.stall_s += new
            self._stats.last_stall_s += new
        return self._stats

    def use_memory(self, tier: Any, gate: Any = None) -> None:
        """Keep the saves whose target asks for it in ``tier`` too (a :class:`~ckpt.memory.MemoryTier`),
        counted in this pipeline's :class:`SaveStats`. ``gate``: a :class:`~ckpt.memory.MemoryGate`
        deciding memory-only saves (with staging): taken when every rank's previous saves left a
        buffer set free, else skipped, without waiting and without a blocking collective."""
        tier.stats = self._stats
        self.memory, self._gate = tier, gate

    # -- before the live state changes ---------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer | None = None, *, model: torch.nn.Module | None = None) -> None:
        """Wait for a pending snapshot before ``optimizer.step()`` and before the forward of every
        module of ``model`` that holds persistent buffers (:meth:`SnapshotHooks.attach`)."""
        self._hooks.attach(optimizer, model=model)

    def attach_everywhere(self) -> None:
        """Wait for a pending snapshot before any optimizer's step and, once after each snapshot, before
        the next forward of any module (:meth:`SnapshotHooks.attach_everywhere`)."""
        self._hooks.attach_everywhere()

    @property
    def hooks(self) -> list[Any]:
        """What :meth:`attach` and :meth:`attach_everywhere` registered (empty once closed)."""
        return self._hooks.hooks

    def before_step(self) -> None:
        """Block until the last snapshot no longer needs the live tensors (on an accelerator: order
        the compute stream after the copy, without blocking the host)."""
        if self.stager is None:
            return
        start = time.perf_counter()
        self.stager.wait_snapshot()
        waited = time.perf_counter() - start
        self._stats.stall_s += waited
        self._stats.last_stall_s += waited

    # -- saving ------------------------------------------------------------------------------------
    def save(self, target: Target, tree: Any, *, since: float | None = None, stacklevel: int = 2) -> Started | None:
        """Save ``tree`` to ``target``; None when it was not (skipped, or failed under
        ``on_error="continue"``). ``since``: when the caller began this save (its preparation is
        stall too); ``stacklevel``: of a warning, as ``warnings.warn`` counts from here. Collective
        through ``agree``: every rank saves in the same order (a memory-only save through the gate)."""
        start = time.perf_counter() if since is None else since
        if self._gate is not None and self.stager is not None:
            try:
                return (self._save_memory(target, tree, start) if target.write is None
                        else self._save(target, tree, start, stacklevel + 1))
            finally:  # every save call on every rank: the next memory-only save's decision
                self._gate.post(self.stager.has_free_set())
        return self._save(target, tree, start, stacklevel + 1)

    def _save(self, target: Target, tree: Any, start: float, stacklevel: int) -> Started | None:
        stager = self.stager
        signature = None if stager is None else tensor_signature(tree)
        again = None if stager is None else self.deltas.same_state(target, signature)
        failed, busy, full, fresh = self._agree((
            bool(self.failures),
            stager is not None and self.options.policy is BusyPolicy.SKIP and not stager.has_free_set(),
            stager is not None and not self.deltas.eligible(target, signature),
            again is None))
        if failed:  # one rank noticed: all finish their writes, all raise (or warn) here
            self.inflight.drain()
            self._raise_failures(stacklevel + 1)
        if stager is None:
            return self._write_now(target, tree, start, stacklevel + 1)
        readers = None if fresh else self._readers
        if readers is not None and not readers.join():  # its writes ended: its buffer set may be reused
            fresh = True  # and a full (a save of the same step is never a delta), as on the other ranks
        if fresh and busy:
            self._stats.skipped += 1
            warnings.warn(f"checkpoint of {target} skipped: both staging buffers are still being written",
                          stacklevel=stacklevel)
            return None
        if fresh:
            snapshot, base, readers = self._snapshot(target, tree, signature, full=full)
            plain = None
        else:  # the last snapshot, to a second destination: its buffer set stays busy until this write ends too
            self.deltas.copied(target)
            snapshot, base, plain = again, None, tree
        return self._queue(target, snapshot, plain, readers, base, start)

    def _save_memory(self, target: Target, tree: Any, start: float) -> Started | None:
        """A memory-only save (never a delta, nor a base): skipped when the gate is shut (some rank
        has no free buffer set), else snapshotted and queued; no agreement, no earlier failure
        raised (the next storage save or ``wait`` raises it)."""
        if not self._gate.open():
            return None
        # no signature (one walk of the tree fewer): never a base nor a second destination, nothing compares it
        snapshot, _, readers = self._snapshot(target, tree, None, full=True)
        return self._queue(target, snapshot, None, readers, None, start)

    def _snapshot(self, target: Target, tree: Any, signature: tuple | None, *,
                  full: bool) -> tuple[Future, Hashable | None, _Readers]:
        """Start the snapshot of ``tree`` into a free buffer set; the snapshot, its delta base's key, its readers."""
        self._readers = readers = _Readers()  # the write queued next: it releases the buffer set when it ends
        snapshot = self.stager.stage(tree, keep_previous=not full, release=readers.released, signature=signature)
        base = self.deltas.started(target, snapshot, signature, delta=not full)
        self._stats.deltas += base is not None
        self._hooks.snapshot_taken()
        return snapshot, base, readers

    def _queue(self, target: Target, snapshot: Future, plain: dict | None, readers: _Readers,
               base: Hashable | None, start: float) -> Started:
        """Hand the write of ``snapshot`` to ``target`` to the writer thread."""
        future = self._writer.submit(self._run, target, snapshot, plain, readers)
        self.inflight.add(target.key, future)
        future.add_done_callback(lambda f, key=target.key: self.inflight.remove(key))
        self._stats.count_save(time.perf_counter() - start, stored=target.write is not None)
        return Started(base)

    def forget(self, key: Hashable) -> None:
        """The checkpoint at ``key`` is going away: no later save is a delta of it."""
        self.deltas.forget(key)

    def wait_for(self, key: Hashable) -> None:
        """Block until the write to ``key`` in flight (if any) has ended."""
        self.inflight.drain(key)

    def wait(self, *, stacklevel: int = 2) -> None:
        """Block until every started save is committed; raise (or warn about) the first background error."""
        self.inflight.drain()
        if self.stager is not None:
            self.stager.wait_snapshot(host=True)
        self._raise_failures(stacklevel + 1)

    def raise_failures(self, *, stacklevel: int = 2) -> None:
        """Raise (``on_error="stop"``) or warn about (``continue``) the failures recorded so far."""
        self._raise_failures(stacklevel + 1)

    def close(self, *, stacklevel: int = 2) -> None:
        """Wait (raising a background error), then remove the hooks, stop the writer thread, free the buffers."""
        try:
            self.wait(stacklevel=stacklevel + 1)
        finally:
            self._hooks.remove()
            self._writer.shutdown(wait=True)
            if self._gate is not None:
                self._gate.close()
            self.deltas.clear()  # the last snapshot, held as the next save's base, lets go of its buffers
            if self.stager is not None:
                self.stager.close()

    # -- internals ---------------------------------------------------------------------------------
    def _write_now(self, target: Target, tree: Any, start: float, stacklevel: int) -> Started | None:
        self.deltas.started(target, None, None, delta=False)
        failed = True
        try:
            self._write(target, tree, None)
            failed = False
        except Exception as error:
            self.failures.add(error)
            self._raise_failures(stacklevel + 1)
            return None
        finally:
            self.deltas.finished(target.key, failed=failed)
            self._stats.count_save(time.perf_counter() - start, stored=target.write is not None)
        return Started()

    def _run(self, target: Target, snapshot: Future, plain: dict | None, readers: _Readers) -> None:
        """The writer thread's task: :meth:`_persist`, then the write's end recorded, before its future
        is done: whoever waited for it finds its failure counted and its buffer set free (the memory
        gate's next post, a test's ``wait``)."""
        failed = True
        try:
            self._persist(target, snapshot, plain)
            failed = False
        except BaseException as error:
            self.failures.add(error)
            raise
        finally:
            self.deltas.finished(target.key, failed=failed)  # a delta must never build on a failed write
            readers.leave()

    def _persist(self, target: Target, snapshot: Future, plain: dict | None) -> None:
        """Wait for the snapshot (and the base's), write, commit. ``plain``: the (flat) tree of a
        second save of the last snapshot, whose values other than tensors are its own."""
        base = self.deltas.base_for(target.key)
        staged = snapshot.result()
        if plain is not None:
            staged = {k: staged[k] if isinstance(v, torch.Tensor) else v for k, v in plain.items()}
        self._write(target, staged, base)

    def _write(self, target: Target, tree: Any, base: DeltaBase | None) -> None:
        """Every destination of one save: the memory tier first (fast, and a failure there is only
        counted), then the target's own."""
        if target.memory and self.memory is not None:
            self.memory.save(target.step, tree)
        if target.write is not None:
            target.write(tree, base)

    def _raise_failures(self, stacklevel: int) -> None:
        self.failures.raise_or_warn(self._stats, stacklevel=stacklevel + 1)

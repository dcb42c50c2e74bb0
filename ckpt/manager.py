"""CheckpointManager: periodic, asynchronous, retained checkpoints of a training run under one root.

    manager = CheckpointManager("ckpts", interval=100, keep=3)
    manager.attach(optimizer)               # snapshot copies finish before the next optimizer step
    start = manager.load(state) or 0       # latest committed step, or None
    for step in range(start + 1, steps + 1):
        train_step()
        manager.save(step, state)           # returns at once; bytes are written in the background
    manager.close()                         # waits; raises any background error

The manager only schedules; each concept lives in its module. One save, top to bottom:

1. ``save`` (training thread): is the step due? export the state (:mod:`ckpt.state`); hand it, with
   its step directory as the target, to the save pipeline (:mod:`ckpt.write.pipeline`, shared with the
   path-based plug-ins), which decides with every rank whether it is a delta (:mod:`ckpt.write.delta`),
   starts the snapshot into a free staging buffer set (:mod:`ckpt.write.staging`; plain values are
   captured synchronously) and queues the write.
2. the pipeline's writer thread: wait for the snapshot; write it through DCP and our writer
   (:mod:`ckpt.dcp` → :mod:`ckpt.write.files` → :mod:`ckpt.commit`) on its own gloo process group, so
   its collectives never interleave with training's;
3. rank 0 applies retention (:mod:`ckpt.root.retention`) to the root (:mod:`ckpt.root.steps`: step
   names, lock, start-up clean-up, delta bases; the run identity every manifest records and every
   mount is claimed for: :mod:`ckpt.root.claim`); the replicator (:mod:`ckpt.root.replicate`) copies
   the step to each replica and applies the same retention there.

A background failure is raised by the next ``save``/``wait``/``close``. ``async_mode="sync"``
writes inside ``save`` instead.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist

from .api import load_with_manifest, write_tree
from .collective import Agreement, any_rank, broadcast_value, run_on_src
from .dcp import Writer
from .errors import CheckpointError, CheckpointNotFoundError
from .format import step_name
from .options import SaveOptions
from .outcomes import CommitInfo, LoadStats, SaveStats, tell_commit
from .root import resume, retention
from .root.catalog.updates import CatalogUpdates
from .root.claim import claim_primary
from .root.mounts import open_mounts, start_replicator
from .state import export_state
from .state_names import StateNames
from .write.delta import DeltaBase
from .write.pipeline import SavePipeline, Target

log = logging.getLogger(__name__)


class CheckpointManager:
    """Periodic checkpoints of one run under ``root`` (see the module docstring).

    Configured by a :class:`~ckpt.options.SaveOptions` (``options``), whose fields may also be
    given, or overridden, as keyword arguments: ``CheckpointManager("ckpts", interval=100, keep=3)``.
    See :class:`~ckpt.options.SaveOptions` for each field.

    Collective: every rank constructs it, and calls ``save``/``load``/``close`` in the same order.
    """

    def __init__(self, root: str | os.PathLike, options: SaveOptions | None = None, *,
                 storage_options: dict | None = None, on_commit: Callable[[CommitInfo], None] | None = None,
                 **overrides: Any):
        self.options = options = (options or SaveOptions()).replace(**overrides)
        self._mounts = open_mounts(root, options.replicas, storage_options)
        self._root = self._mounts[0]
        self.root = self._root.path
        self._load_stats = LoadStats()
        self._on_commit = on_commit
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        # Background writes and the main thread's agreements each get their own gloo group.
        self._control_pg = dist.new_group(backend="gloo") if self._distributed else None
        self._write_pg = dist.new_group(backend="gloo") if self._distributed else None
        run_on_src(self._lock_primary if self.rank == 0 else lambda: None, self._control_pg,
                   distributed=self._distributed)
        self._catalog, self._replicator, self._memory_pg, self._closed = CatalogUpdates(None), None, None, False
        self._pipeline: SavePipeline | None = None
        try:  # from here on the root is held: a constructor that fails lets go of it (and of what it started)
            self.run = self._root.run = broadcast_value(self._root.run, self._control_pg, distributed=self._distributed)
            self._catalog = (CatalogUpdates.open(options.catalog, self._root.path, [m.path for m in self._mounts])
                             if self.rank == 0 else CatalogUpdates(None))
            self._replicator = start_replicator(self._mounts, options, distributed=self._distributed,
                                                on_state=self._catalog.replica_state, run=self.run)
            # snapshot, delta chain, writer thread, hooks, counters, background errors: ckpt.write.pipeline
            self._pipeline = SavePipeline(options, agree=lambda flags: any_rank(flags, self._control_pg,
                                                                                distributed=self._distributed))
            if options.memory is not None:  # host RAM of each node, a partner's copy: ckpt.memory
                from .memory import MemoryGate, MemoryTier, local_world_size

                world = dist.get_world_size() if self._distributed else 1
                self._memory_pg = dist.new_group(backend="gloo") if self._distributed else None
                # each node's own folder: a node that cannot open its folder stops every rank, with its error
                tier = Agreement(self._control_pg, distributed=self._distributed).each(lambda: MemoryTier(
                    options.memory, self.run, rank=self.rank, world=world, local_world=local_world_size(world),
                    group=self._memory_pg, keep=options.memory_keep, replicas=options.memory_replicas))
                # memory-only saves: no blocking collective per step
                self._pipeline.use_memory(tier, MemoryGate(self._control_pg))
        except BaseException:
            try:
                if self._pipeline is not None:  # no save started: nothing to wait for
                    self._pipeline.close()
            finally:
                self._release()
            raise
        self.loaded_from: str | None = None  # "memory" or "storage": where the last load's step came from
        self._names = StateNames()  # torch's names of the state's values, kept between saves

    # -- training-loop API -----------------------------------------------------------------------
    @property
    def stats(self) -> SaveStats:
        """The counters, with the device stall measured so far added in."""
        return self._pipeline.stats

    @property
    def load_stats(self) -> LoadStats:
        """What the last :meth:`load` moved on this rank (bytes read from storage, from peers)."""
        return self._load_stats

    def attach(self, optimizer: torch.optim.Optimizer | None = None, *, model: torch.nn.Module | None = None) -> None:
        """Wait for a pending snapshot right before the live state first changes: before
        ``optimizer.step()`` and, with ``model``, before the forward of every module that holds
        persistent buffers (BatchNorm running statistics change in forward; so do the buffers DDP
        broadcasts when it starts its forward). Other in-place writes to checkpointed tensors (an EMA
        updated by the loop, say) must call :meth:`before_step` first."""
        self._pipeline.attach(optimizer, model=model)

    def before_step(self) -> None:
        """Block until the last snapshot no longer needs the live tensors (on an accelerator:
        order the compute stream after the copy, without blocking the host)."""
        self._pipeline.before_step()

    def save(self, step: int, state: dict[str, Any], *, force: bool = False, memory: bool | None = None) -> bool:
        """Checkpoint ``state`` as ``step`` if due (``step % interval == 0``) or forced; with the memory
        tier on, also (or only) into memory when ``step % memory_interval == 0`` (``memory=False``: not
        this save, e.g. a final model-only export; ``True``: whatever the interval).

        Returns whether a save was started. Returns before the bytes are on disk (async mode).
        A failed earlier save is raised (or warned about) here, at a due step, on every rank at once."""
        self._check_open()
        stored = force or not step % self.options.interval
        memory = self._pipeline.memory is not None and (not step % self.options.memory_interval
                                                         if memory is None else memory)
        if not (stored or memory):
            return False
        start = time.perf_counter()
        tree, _ = export_state(state, names=self._names)
        if stored:
            target = Target(step, step, lambda staged, base: self._persist(step, staged, base),
                            folder=str(self.root), name=step_name(step), memory=memory)
        else:  # the memory tier only: never a delta's base, never a storage step
            target = Target(("memory", step), step, None, memory=True)
        return self._pipeline.save(target, tree, since=start, stacklevel=3) is not None

    def wait(self) -> None:
        """Block until every started save is committed; raise the first background error."""
        self._pipeline.wait(stacklevel=3)

    def load(self, state: dict[str, Any], step: int | None = None, *, strict: bool = True) -> int | None:
        """Load ``step`` (default: the newest committed step that loads, see :mod:`ckpt.root.resume`) into
        ``state``; return the step loaded, or None when the root holds no checkpoint."""
        self._check_open()
        self.wait()
        self._load_stats = stats = LoadStats()  # every attempt of this load, a fallback's included

        agree = Agreement(self._control_pg, distributed=self._distributed)

        def load(target: dict, path, mirrors) -> None:  # each rank reads the manifest; all agree before DCP
            manifest = agree.each(lambda: self._root.manifest_at(path))
            load_with_manifest(target, path, manifest, strict=strict,
                               process_group=self._control_pg, mirrors=mirrors, stats=stats)

        self.loaded_from = None
        if step is not None:
            try:
                return self._stored(resume.load_step(self._mounts, state, step, load, run=self.run, agree=agree))
            except CheckpointNotFoundError as exc:  # a memory step is never history: say so where one is
                why = self._pipeline.memory.why_not_stored(step) if self._pipeline.memory is not None else None
                if why is None:
                    raise
                raise CheckpointNotFoundError(f"{exc}; {why}", path=exc.path) from exc
        recovered = self.recover_memory(state, strict=strict)  # newer than storage after a crash, from RAM
        if recovered is not None:
            return recovered
        return self._stored(resume.load_latest(self._mounts, state, load, run=self.run, agree=agree,
                                               on_set_aside=lambda mount, old, _: self._catalog.forget(mount.path, old)))

    def _stored(self, step: int | None) -> int | None:
        self.loaded_from = None if step is None else "storage"
        return self._going_on_from(step)

    def _going_on_from(self, step: int | None) -> int | None:
        """The memory tier's steps after ``step`` are another history from now on (see
        :meth:`ckpt.memory.MemoryTier.going_on_from`)."""
        if self._pipeline.memory is not None:
            self._pipeline.memory.going_on_from(step)
        return step

    def recover_memory(self, state: dict[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest memory-tier step every rank can assemble (see :mod:`ckpt.memory.tier`) when
        it is at least as new as storage's newest step; None (nothing loaded) otherwise, or without
        the tier. Collective. ``load()`` tries this first; a caller that loads storage its own way
        (a model-only step into the model alone) asks for it apart."""
        self._check_open()
        self.wait()
        if self._pipeline.memory is None:
            return None
        stored = self.steps(agreed=True)
        step = self._pipeline.memory.recover(state, stored[-1] if stored else None, strict=strict)
        if step is not None:
            self.loaded_from = "memory"
            self._going_on_from(step)
        return step

    @property
    def memory_note(self) -> str | None:
        """The memory tier's one line about the last load (every rank; logged by rank 0): the memory
        step it resumed from, or why storage was used instead; None without the tier or a word to say."""
        return None if self._pipeline.memory is None else self._pipeline.memory.note

    def discard_after(self, step: int) -> list[int]:
        """Delete every committed step after ``step`` on every mount (rank 0; collective), and the
        memory tier's (each node's first rank), so that training on from ``step`` leaves one history,
        not two interleaved. Returns the steps deleted
        on the primary (every rank); a mount where that fails raises on every rank, the primary then untouched
        (:func:`~ckpt.root.retention.discard_after_on_mounts`)."""
        self._check_open()
        self.wait()
        # rank 0 deletes; its list, or its error (naming the mount and step), on every rank. No replica
        # copy is in flight there meanwhile: one that read a later step before its deletion would commit
        # it after (rank 0 only: its copies need no other rank's main thread, so nothing waits in a circle)
        replicating = self._replicator is not None and self.rank == 0
        with self._replicator.branching if replicating else nullcontext():
            deleted = Agreement(self._control_pg, distributed=self._distributed).decided(
                lambda: retention.discard_after_on_mounts(self._root, self._mounts[1:], step,
                                                          deleted=lambda m, old: self._catalog.forget(m.path, old)))
        if self._pipeline.memory is not None:  # and the memory tier's: a crash before the next save must not resume them
            self._pipeline.memory.forget_after(step)
        return deleted

    def replication_status(self) -> dict[int, dict[str, str]]:
        """``{step: {replica url: state}}``: pending, copying, committed, failed or dropped (see
        :mod:`ckpt.root.replicate`); empty without replicas."""
        return {} if self._replicator is None else self._replicator.status()

    def steps(self, *, agreed: bool = False) -> list[int]:
        """Committed steps under the root, ascending; ``agreed``: rank 0's listing on every rank
        (collective), for a decision every rank must take alike."""
        if agreed:
            return Agreement(self._control_pg, distributed=self._distributed).decided(self._root.steps)
        return self._root.steps()

    def manifest(self, step: int):
        """The manifest of committed ``step`` under the root (read once per resume: the listing's)."""
        return self._root.manifest(step)

    def close(self, *, finished: bool = True) -> None:
        """Wait for every save and, up to ``close_timeout`` seconds, for pending replication; free the
        staging buffers, release the root. Raises a background error. ``finished``: the run ended
        well, so its memory-tier steps go (unless ``memory_keep_on_exit``); after a failure
        (``finished=False``, or leaving a ``with`` block by an exception) they stay for the restart."""
        if self._closed:
            return
        try:
            self._pipeline.close(stacklevel=3)  # waits; then hooks, writer thread, staging buffers
            if self._pipeline.memory is not None:
                self._pipeline.memory.close(finished=finished, keep_on_exit=self.options.memory_keep_on_exit)
        finally:
            self._release()

    def _release(self) -> None:
        """Let go of the root and of what the manager started (replication, the catalog, its groups)."""
        self._closed = True
        if self._replicator is not None and not self._replicator.close(self.options.close_timeout):
            log.warning("replication unfinished at close (%s); the next manager on this root catches up",
                        self._replicator.status())
        self._catalog.close()
        self._root.unlock()
        for group in (self._control_pg, self._write_pg, self._memory_pg,
                      *(self._replicator.groups if self._replicator else ())):
            if group is not None:
                dist.destroy_process_group(group)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: do not hide that error behind a background one
            self.close(finished=False)
        except CheckpointError as background:
            log.error("checkpoint error while closing after a failure: %s", background)

    # -- internals ---------------------------------------------------------------------------------
    def _lock_primary(self) -> None:
        """Rank 0: lock the root and claim it for this run (:mod:`ckpt.root.claim`)."""
        self._root.lock(claim=lambda root: claim_primary(root, self._mounts[1:]))

    def _write(self, step: int, tree: dict, base: DeltaBase | None = None) -> None:
        writer = Writer(self._root.step_path(step), overwrite=True, step=step, base=base, options=self.options)
        writer.before_begin, writer.before_commit, writer.run = self._root.check_writable, self._root.check_held, self.run
        start = time.perf_counter()
        write_tree(tree, writer, process_group=self._write_pg, no_dist=not self._distributed)
        self._root.forget(step)  # what was read of an older copy of this step is stale now
        if writer.manifest is not None:  # the coordinator
            self._catalog.committed(self._root.path, step, writer.manifest)
            self._tell_commit(step, writer.manifest, time.perf_counter() - start)

    def _tell_commit(self, step: int, manifest, seconds: float) -> None:
        tell_commit(self._on_commit, CommitInfo(step, manifest.kind, sum(manifest.files.values()), seconds,
                                                str(self._root.step_path(step)), len(self.options.replicas)))

    def _persist(self, step: int, tree: dict, base: DeltaBase | None) -> None:
        """The writer thread (the pipeline's target): write, commit, replicate, retain."""
        self._write(step, tree, base)
        self._after_commit(step)

    def _after_commit(self, step: int) -> None:
        if self._replicator is not None:
            self._replicator.submit(step)
        if self.rank != 0:
            return
        in_flight = self._pipeline.inflight.writing(besides=step)
        retention.apply(self._root, keep=self.options.keep, keep_every=self.options.keep_every, protected=in_flight,
                        bases_in_flight=self._pipeline.deltas.bases_in_flight(),
                        deleted=lambda old: self._catalog.forget(self._root.path, old))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")


"""MemoryTier: every step in host RAM (a tmpfs directory of each node), a copy on a partner node, and
recovery from them in seconds — storage stays the backstop.

    tier = MemoryTier(directory, run, rank=r, world=w, local_world=l, group=gloo_group)   # every rank
    tier.save(step, staged_tree)      # the save pipeline's writer thread; a tier failure never raises
    step = tier.recover(state, newest_storage_step)       # start-up, every rank: the step loaded, or None

A memory step is one ordinary checkpoint of ours per rank (the rank's local shards, written by
:func:`~ckpt.memory.local.write_local`, without DCP's planner or collectives: same format, checksums
while writing, manifest last;
a DTensor is kept as its local tensor, a plain tensor of the rank's own, and loaded back into it)
in ``<directory>/<run>/step-N/rank-R`` (:mod:`ckpt.memory.store`). One save, on every rank in the
same order (the pipeline's saves are agreed):

0. once, at the first memory save after a load: each node's first rank removes the memory steps
   after the step the run goes on from (:meth:`MemoryTier.going_on_from`: a branch's or an older
   load's abandoned history, which a later crash must never resume nor mix with the new steps);
1. room: this rank's bytes, twice with a partner (its own files and its source's copy), must fit the
   tmpfs; every rank votes; a save that does not fit somewhere is skipped on all (one warning on each
   rank short of room, ``SaveStats.memory_skipped``), storage saves unaffected;
2. write this rank's checkpoint; 3. copy it to the partner rank and take the source rank's copy
   (:mod:`ckpt.memory.partner`, a gloo group of its own, hashed and verified);
4. one all-reduce: every rank's own and partner copies in place? Then each node's first rank marks
   the step complete and drops older ones (``keep``); else the step is removed (``memory_failures``).

Recovery (every rank, before the storage resume): each node's incomplete steps are removed; the
ranks gather what every node holds; the newest step every rank can assemble — from its node, or from
the partner node that holds its copy (fetched over the group) — is loaded, unless storage holds a newer
step, the step was saved by another layout (its manifests record the world size and a signature of
the rank's tensors), or a fetch or load fails on any rank: then None, with one line saying why, and
the caller resumes from storage. Memory steps are never history for storage's retention or the
branch guard: they live only here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, InvalidOptionError,
                      UnsafeCheckpointError)
from ..outcomes import SaveStats
from ..read import read_manifest
from ..read.gc_pause import paused_gc
from .local import export_for_load, flat_local, layout_of, load_local, tensor_bytes_of, write_local
from .nodes import node_of, partner_rank, readers_by_step, source_rank
from .partner import exchange_copies, swap
from .store import NodeStore

log = logging.getLogger(__name__)

ROOM_MARGIN = 16 << 20  # beside the data: manifests, a file system's own blocks
_DAMAGE = (CorruptCheckpointError, CheckpointNotFoundError)  # a copy that failed its check, or went: the other one may do


class MemoryTier:
    """See the module docstring. ``group``: a gloo group of every rank, used by nothing else (None
    when not distributed); ``replicas``: 1 (a partner copy) or 0; ``stats``: the counters to add to."""

    def __init__(self, directory: str | os.PathLike, run: str, *, rank: int = 0, world: int = 1,
                 local_world: int | None = None, group: dist.ProcessGroup | None = None, keep: int = 2,
                 replicas: int = 1, stats: SaveStats | None = None):
        self.rank, self.world = rank, world
        self.local_world = local_world or world
        self.group, self.distributed = group, group is not None
        self.keep, self.run = keep, run
        self.stats = stats if stats is not None else SaveStats()
        self.node = node_of(rank, self.local_world)
        self.leader = rank % self.local_world == 0  # the node's first rank: marks, retains, cleans
        try:
            self.store = NodeStore(directory, run, node=self.node)
        except (CheckpointNotFoundError, UnsafeCheckpointError) as exc:  # the option's value, named as it
            raise InvalidOptionError("memory", os.fspath(directory), str(exc)) from exc
        self.partner = partner_rank(rank, world, self.local_world) if replicas else None
        self.source = source_rank(rank, world, self.local_world) if replicas else None
        if replicas and self.partner is None and rank == 0:
            log.warning("memory tier: one node, so no partner copy (a lost node loses its memory steps; "
                        "storage is the backstop)")
        self._warned_room = False
        self._going_on_from: int | None = None  # the step the run goes on from (going_on_from)
        self._one_history = False  # memory steps after it removed on every node (the first memory save)
        self.note: str | None = None  # the last recovery's one line (every rank), None when it had nothing to say

    # -- saving (the writer thread) -----------------------------------------------------------------
    def save(self, step: int, tree: Any) -> bool:
        """Put ``tree`` (this rank's staged state) in memory as ``step``; whether the step counts.

        The cyclic garbage collector is paused meanwhile (:func:`ckpt.read.gc_pause.paused_gc`): a
        save builds some ten thousand short-lived, acyclic objects (records, manifests, a received
        manifest parsed) every step; collections while they live would promote them and bring on
        full collections of the whole training process (measured: one of ~150 ms every 40 steps of
        the debug model, every thread held up, and ~1 ms per save in younger generations)."""
        with paused_gc():
            return self._save(step, tree)

    def _save(self, step: int, tree: Any) -> bool:
        flat, paths = flat_local(tree)  # the one walk of the tree: room, layout, records
        need = tensor_bytes_of(flat) * (2 if self.partner is not None else 1) + ROOM_MARGIN
        after = step - 1 if self._going_on_from is None else self._going_on_from
        unsettled = None if self._one_history else self._remove_after(after)  # first: it frees room
        free = self.store.free_bytes()
        if not self._all(free >= need and unsettled is None):
            self.stats.memory_skipped += 1
            if unsettled is not None:
                log.warning("memory save of step %d skipped: memory steps after step %d (another history) could "
                            "not be removed: %s; storage saves go on", step, after, unsettled)
            elif free < need and not self._warned_room:
                self._warned_room = True
                log.warning("memory save of step %d skipped: %s has %.1f MiB free, %.1f MiB needed (own files "
                            "and a partner's copy); storage saves go on", step, self.store.path, free / 2**20,
                            need / 2**20)
            return False
        self._one_history = True
        error = self._write_and_swap(step, flat, paths)
        if not self._all(error is None):
            self.stats.memory_failures += 1
            log.warning("memory save of step %d failed%s; storage saves go on", step,
                        f" on this rank: {error}" if error is not None else " on another rank")
            if self.leader:
                self.store.remove_step(step)
            return False
        if self.leader:
            self.store.mark_complete(step, self.store.committed_ranks(step), local_world=self.local_world)
            self.store.retain(self.keep)
        self.stats.memory_saves += 1
        return True

    def _write_and_swap(self, step: int, flat: dict, paths: dict) -> BaseException | None:
        error, committed = None, None
        own = self.store.rank_location(step, self.rank)
        try:
            self.store.prepare_step(step)
            committed = write_local(flat, paths, own, step=step, run=self.run, user=self._metadata(flat))
        except (CheckpointError, OSError) as exc:
            error, own = exc, None
        if self.partner is None or not self.distributed:
            return error
        try:  # always take part, so the partner is never left waiting
            swap(own, self.partner, self.store.rank_location(step, self.source), self.source, self.group,
                 committed=committed)
        except (CheckpointError, OSError) as exc:
            error = error or exc
        return error

    # -- one history ------------------------------------------------------------------------------
    def going_on_from(self, step: int | None) -> None:
        """The run goes on from ``step`` (the step loaded; None: none, from scratch). Memory steps
        after it belong to a history the run leaves (a branch, an older step loaded, a memory step
        that could not be used): a crash later must never resume from them, nor mix their files with
        the new steps of the same numbers. They are removed on every node at the first memory save
        that follows (before it writes; not at the load, so a start refused after its load loses
        nothing). Without this call, the first memory save removes those at or after its own step."""
        self._going_on_from, self._one_history = step, False

    def forget_after(self, step: int) -> None:
        """Remove the memory steps after ``step`` now (each node's first rank; every rank calls it,
        no collective), as a branch from ``step`` deletes storage's; the later saves go on from it.
        A failure is logged and tried again at the next memory save, which waits for it."""
        self.going_on_from(step)
        error = self._remove_after(step)
        if error is not None:
            log.warning("memory steps after step %d not removed yet: %s (tried again at the next memory save)",
                        step, error)

    def _remove_after(self, after: int) -> BaseException | None:
        """This node's memory steps after ``after`` removed by its first rank; the error, if that failed."""
        if not self.leader:
            return None
        try:
            removed = self.store.remove_after(after)
        except (CheckpointError, OSError) as exc:
            return exc
        if removed:
            log.info("memory tier: removed the memory steps %s of node %d (after step %d, where this run goes on "
                     "from)", ", ".join(map(str, removed)), self.node, after)
        return None

    def _metadata(self, flat: dict) -> dict:
        return {"memory": {"world": self.world, "rank": self.rank, "layout": layout_of(flat)}}

    # -- recovery (start-up) ------------------------------------------------------------------------
    def recover(self, state: dict, newest_storage: int | None, *, strict: bool = True) -> int | None:
        """Load the newest memory step every rank can assemble into ``state``; None (nothing loaded,
        the reason logged once) when there is none, storage is newer, or anything fails."""
        self.note = None
        if self.leader:
            self.store.remove_incomplete()
        holders = self._holders()
        complete = [step for step, held in holders.items() if set(range(self.world)) <= held.keys()]
        if not complete:
            if holders:  # steps there, but some rank's files on no node: say so, once
                newest = max(holders)
                lost = ", ".join(map(str, sorted(set(range(self.world)) - holders[newest].keys())))
                self._say(f"memory step {newest} unusable (rank {lost}: its files are on no node): resuming from storage")
            return None
        step = max(complete)
        if newest_storage is not None and newest_storage > step:
            self._say(f"memory step {step} is older than storage step {newest_storage}: resuming from storage")
            return None
        everyone = set(range(self.world))
        readers = {r: held for r, held in holders[step].items() if r in everyone}  # not another layout's
        fetch = {r: held[0] for r, held in readers.items() if held[0] != r}  # a replaced node's ranks
        failures, loaded = self._assemble(step, state, fetch, everyone, strict)
        repair = {r: readers[r][1] for r, (_, damaged) in failures.items() if damaged and len(readers[r]) > 1}
        if failures and repair.keys() == failures.keys():  # own copies damaged: the partner node's instead
            first = failures
            failures, _ = self._assemble(step, state, repair, set(repair) if loaded else everyone, strict,
                                         overwrite=True)
            failures = {r: (f"{first[r][0]}; its partner's copy: {message}", damaged)
                        for r, (message, damaged) in failures.items()}
        if failures:
            r, (message, _) = min(failures.items())
            self._say(f"memory step {step} unusable (rank {r}: {message}): resuming from storage")
            return None
        said = [f"storage's newest: {newest_storage}"] if newest_storage is not None else []
        if repair:  # what a damaged copy cost: one copy over the network, no storage read
            said.append(f"rank {', '.join(map(str, sorted(repair)))} from the partner's copy, its own failing its check")
        self._say(f"resumed from memory step {step}" + (f" ({'; '.join(said)})" if said else ""),
                  level=logging.WARNING if repair else logging.INFO)
        return step

    def why_not_stored(self, step: int) -> str | None:
        """The line for a storage load of ``step`` that found none, when this node holds it in memory."""
        if step in self.store.complete_steps():
            return f"step {step} is a memory-tier step, loaded only by a load without a step while it is the newest"
        return None

    def _assemble(self, step: int, state: dict, fetch: dict[int, int], loading: set[int], strict: bool, *,
                  overwrite: bool = False) -> tuple[dict[int, tuple[str, bool]], bool]:
        """Every rank: move the files ``fetch`` names (receiving rank -> sending rank), then each rank
        in ``loading`` checks its copy's manifest and, once every rank's check passed, loads it.
        The failures, by rank (what failed; whether it was its copy, damaged or missing), and whether
        the loads were tried (every check passed)."""
        location, manifest, exported, error = self.store.rank_location(step, self.rank), None, None, None
        try:
            self._fetch(step, fetch, overwrite=overwrite)
            if self.rank in loading:
                manifest = read_manifest(location)
                saved = (manifest.user or {}).get("memory", {})
                if saved.get("world") != self.world:
                    raise _Unusable(f"memory step {step} was saved by another layout ({saved.get('world')} "
                                    f"ranks) than this run's ({self.world} ranks)")
                # exported once, as the load wants it: its tensors are those a save's export has (only
                # tensor-free values may be stored otherwise), so its layout is the one to compare
                exported = export_for_load(state, manifest)
                if saved.get("layout") != layout_of(flat_local(exported[0])[0]):  # keys, shard shapes or dtypes
                    raise _Unusable(f"memory step {step} was saved by another layout (this rank's tensors: other "
                                    f"names, shard shapes or dtypes than this run's)")
        except (CheckpointError, OSError) as exc:
            error = exc
        failures = self._failures(error)
        if failures:
            return failures, False
        if self.rank in loading:
            try:
                load_local(state, location, manifest, strict=strict, exported=exported)
            except (CheckpointError, OSError) as exc:
                error = exc
        return self._failures(error), True

    def _holders(self) -> dict[int, dict[int, list[int]]]:
        """Who can read each rank's files of each step every node holds complete
        (:func:`~ckpt.memory.nodes.readers_by_step`, from every rank's listing)."""
        held = {step: sorted(ranks) for step, ranks in self.store.complete_steps().items()}
        gathered = [held]
        if self.distributed:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, held, group=self.group)
        return readers_by_step(gathered, self.world, self.local_world)

    def _fetch(self, step: int, fetch: dict[int, int], *, overwrite: bool = False) -> None:
        """Each rank ``fetch`` names takes its files from the rank named with it (a node holding its
        copy), every pair at once: a rank sends what it holds for others (in rank order, on a
        thread) while it receives its own (:func:`~ckpt.memory.partner.exchange_copies`);
        ``overwrite``: in place of its own copy."""
        sends = [(self.store.rank_location(step, r), r) for r, holder in sorted(fetch.items()) if holder == self.rank]
        source, target, unplaced = fetch.get(self.rank), self.store.rank_location(step, self.rank), None
        if source is not None:
            try:
                self.store.prepare_step(step)
            except (CheckpointError, OSError) as exc:  # its sender is released all the same: nowhere to put it
                target, unplaced = None, exc
        if sends or source is not None:
            try:
                exchange_copies(sends, target, source, self.group, overwrite=overwrite)
            except CheckpointError:
                if unplaced is None:
                    raise
        if unplaced is not None:
            raise unplaced

    def _failures(self, error: BaseException | None) -> dict[int, tuple[str, bool]]:
        """Every rank's failure (collective): rank -> (what failed, whether its copy was damaged or missing)."""
        mine = None if error is None else (str(error), isinstance(error, _DAMAGE) and not isinstance(error, _Unusable))
        errors = [mine]
        if self.distributed:
            errors = [None] * self.world
            dist.all_gather_object(errors, mine, group=self.group)
        return {r: e for r, e in enumerate(errors) if e is not None}

    def _all(self, flag: bool) -> bool:
        if not self.distributed:
            return bool(flag)
        tensor = torch.tensor([int(bool(flag))])
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return bool(tensor.item())

    def _say(self, line: str, level: int = logging.WARNING) -> None:
        self.note = line
        if self.rank == 0:
            log.log(level, line)

    # -- the end of a run ---------------------------------------------------------------------------
    def close(self, *, finished: bool, keep_on_exit: bool = False) -> None:
        """A clean finish removes this run's memory steps (unless ``keep_on_exit``); after a failure
        they stay for the restart."""
        if finished and not keep_on_exit and self.leader:
            self.store.remove_all()


class _Unusable(CheckpointError):
    """A memory step this run cannot load (another layout): not damage, a reason to use storage."""

"""MemoryTier: every step in host RAM (a tmpfs directory of each node), a copy on a partner node, and
recovery from them in seconds — storage stays the backstop.

    tier = MemoryTier(directory, run, rank=r, world=w, local_world=l, group=gloo_group)   # every rank
    tier.save(step, staged_tree)      # the save pipeline's writer thread; a tier failure never raises
    step = tier.recover(state, newest_storage_step)       # start-up, every rank: the step loaded, or None

A memory step is one ordinary checkpoint of ours per rank (the rank's local shards, written by
:class:`ckpt.dcp.Writer` without collectives: same format, checksums while writing, manifest last;
a DTensor is kept as its local tensor, a plain tensor of the rank's own, and loaded back into it)
in ``<directory>/<run>/step-N/rank-R`` (:mod:`ckpt.memory.store`). One save, on every rank in the
same order (the pipeline's saves are agreed):

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

import hashlib
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..api import load_with_manifest, write_tree
from ..errors import CheckpointError
from ..options import SaveOptions
from ..outcomes import SaveStats
from ..read import read_manifest
from ..state import export_state, stored_whole
from ..tree import descend_containers, leaves, transform
from ..write.delta import tensor_signature
from ..write.storage_writer import Writer
from .nodes import node_of, partner_rank, source_rank
from .partner import receive_checkpoint, send_checkpoint, swap
from .store import NodeStore

log = logging.getLogger(__name__)

ROOM_MARGIN = 16 << 20  # beside the data: manifests, a file system's own blocks
_WRITE_OPTIONS = SaveOptions()  # one file per rank, raw: the fastest to write and read back


def layout_of(tree: Any) -> str:
    """A short digest of a rank's tensor layout (local shapes and dtypes, in order): a memory step
    loads only where this is unchanged."""
    return hashlib.sha256(repr(tensor_signature(tree)).encode()).hexdigest()[:16]


def local_tree(tree: Any) -> Any:
    """``tree`` with each DTensor replaced by its local tensor (the same memory): a rank's own
    checkpoint holds its shards whole, as plain tensors (a DTensor's would not cover its global shape)."""
    return transform(tree, descend_containers(lambda leaf: leaf.to_local() if isinstance(leaf, DTensor) else leaf))


def load_local(state: dict, location: Any, manifest: Any, *, strict: bool) -> None:
    """Load a rank's own checkpoint (:func:`local_tree`'s) into ``state``: DCP fills each DTensor's
    local tensor in place, then the exported tree, DTensors back in it, goes to the user's objects."""
    tree, restore = export_state(state, stored_whole(set(manifest.values), [*manifest.values, *manifest.tensors]))
    swapped = _swap_local(tree)
    try:
        load_with_manifest(tree, location, manifest, strict=strict, no_dist=True)
    finally:
        for container, key, dtensor in swapped:
            container[key] = dtensor
    restore()


def _swap_local(node: Any, swapped: list | None = None) -> list:
    """Replace, in place, each DTensor in ``node``'s dicts and lists by its local tensor; the
    ``(container, key, dtensor)`` replaced, to put back."""
    swapped = [] if swapped is None else swapped
    for key, value in list(node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()):
        if isinstance(value, DTensor):
            swapped.append((node, key, value))
            node[key] = value.to_local()
        else:
            _swap_local(value, swapped)
    return swapped


def tree_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in leaves(tree) if isinstance(t, torch.Tensor))


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
        self.store = NodeStore(directory, run, node=self.node)
        self.partner = partner_rank(rank, world, self.local_world) if replicas else None
        self.source = source_rank(rank, world, self.local_world) if replicas else None
        if replicas and self.partner is None and rank == 0:
            log.warning("memory tier: one node, so no partner copy (a lost node loses its memory steps; "
                        "storage is the backstop)")
        self._warned_room = False
        self.note: str | None = None  # the last recovery's one line (every rank), None when it had nothing to say

    # -- saving (the writer thread) -----------------------------------------------------------------
    def save(self, step: int, tree: Any) -> bool:
        """Put ``tree`` (this rank's staged state) in memory as ``step``; whether the step counts."""
        need = tree_bytes(tree) * (2 if self.partner is not None else 1) + ROOM_MARGIN
        free = self.store.free_bytes()
        if not self._all(free >= need):
            self.stats.memory_skipped += 1
            if free < need and not self._warned_room:
                self._warned_room = True
                log.warning("memory save of step %d skipped: %s has %.1f MiB free, %.1f MiB needed (own files "
                            "and a partner's copy); storage saves go on", step, self.store.path, free / 2**20,
                            need / 2**20)
            return False
        error = self._write_and_swap(step, tree)
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

    def _write_and_swap(self, step: int, tree: Any) -> BaseException | None:
        error = None
        own = self.store.rank_location(step, self.rank)
        tree = local_tree(tree)
        try:
            self.store.prepare_step(step)
            writer = Writer(own, overwrite=True, step=step,
                            options=_WRITE_OPTIONS.replace(user_metadata=self._metadata(tree)))
            writer.run = self.run
            write_tree(tree, writer, process_group=None, no_dist=True)
        except (CheckpointError, OSError) as exc:
            error, own = exc, None
        if self.partner is None or not self.distributed:
            return error
        try:  # always take part, so the partner is never left waiting
            swap(own, self.partner, self.store.rank_location(step, self.source), self.source, self.group)
        except (CheckpointError, OSError) as exc:
            error = error or exc
        return error

    def _metadata(self, tree: Any) -> dict:
        return {"memory": {"world": self.world, "rank": self.rank, "layout": layout_of(tree)}}

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
        try:
            self._fetch(step, holders[step])
            location = self.store.rank_location(step, self.rank)
            manifest = read_manifest(location)
            saved = (manifest.user or {}).get("memory", {})
            tree, _ = export_state(state)
            if saved.get("world") != self.world or saved.get("layout") != layout_of(tree):
                raise _Unusable(f"memory step {step} was saved by another layout ({saved.get('world')} ranks) "
                                f"than this run's ({self.world} ranks)")
            error = None
        except (CheckpointError, OSError) as exc:
            error = exc
        if self._first_error(error, step):
            return None
        try:
            load_local(state, location, manifest, strict=strict)
        except (CheckpointError, OSError) as exc:
            error = exc
        if self._first_error(error, step):
            return None
        self._say(f"resumed from memory step {step}" + (f" (storage's newest: {newest_storage})"
                                                         if newest_storage is not None else ""), level=logging.INFO)
        return step

    def _holders(self) -> dict[int, dict[int, int]]:
        """step -> {rank r: the rank that reads r's files there (r itself when its node holds them)},
        from every node's complete steps."""
        held = {step: sorted(ranks) for step, ranks in self.store.complete_steps().items()}
        gathered = [held]
        if self.distributed:
            gathered = [None] * self.world
            dist.all_gather_object(gathered, held, group=self.group)
        holders: dict[int, dict[int, int]] = {}
        for reader, steps in enumerate(gathered):
            for step, ranks in steps.items():
                holders.setdefault(step, {})  # a complete step every rank's files of which are gone is still named
                for r in ranks:
                    if node_of(reader, self.local_world) == node_of(r, self.local_world):
                        holders.setdefault(step, {})[r] = r  # its own node: read locally
                    else:
                        holders.setdefault(step, {}).setdefault(r, reader)
        return holders

    def _fetch(self, step: int, holders: dict[int, int]) -> None:
        """Ranks whose node lost their files take them from the node that holds the copy, pair by pair
        in rank order (every rank walks the same list)."""
        for r in range(self.world):
            holder = holders[r]
            if holder == r:
                continue
            if self.rank == holder:
                send_checkpoint(self.store.rank_location(step, r), r, self.group)
            elif self.rank == r:
                self.store.prepare_step(step)
                receive_checkpoint(self.store.rank_location(step, r), holder, self.group)

    def _first_error(self, error: BaseException | None, step: int) -> bool:
        """Whether any rank failed; the first failure said once, as the reason storage is used."""
        errors = [error]
        if self.distributed:
            errors = [None] * self.world
            dist.all_gather_object(errors, None if error is None else f"rank {self.rank}: {error}", group=self.group)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            self._say(f"memory step {step} unusable ({first}): resuming from storage")
        return first is not None

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

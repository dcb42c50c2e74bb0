"""Checkpoints at paths a framework chooses: the adapter behind a path-based plug-in.

    store = PathStore(full_every=4)            # SaveOptions fields: async_mode, policy, full_every,
    store.save(tree, "ckpts/epoch=0-step=10.ckpt", step=10)    # on_error, compress, files_per_rank, ...
    tree = store.load("ckpts/epoch=0-step=10.ckpt")            # waits for that path's write first
    store.remove("ckpts/epoch=0-step=10.ckpt")
    store.close()

Lightning's ``CheckpointIO`` and DeepSpeed's ``CheckpointEngine`` are told "write this dict to this
path", "read that path", "delete that path"; which checkpoints exist is the framework's business
(``save_top_k``, its ``latest`` file). Each path becomes one committed checkpoint directory of ours
(:mod:`ckpt.integrations._tree` layout: tensors as tensors, the rest pickle-free), written atomically
with checksums, from this process alone.

Saving is the manager's own pipeline (:class:`ckpt.write.SavePipeline`: snapshot, delta chain,
writer thread, busy policy, hooks, counters, background errors); the store turns a path into its
target and keeps the paths' bookkeeping. With ``async_mode="double_buffer"`` (the default) ``save``
snapshots the tree into reusable host buffers and returns; until the copy is complete, the next
``optimizer.step()`` of any optimizer (and the next module forward, for buffers such as BatchNorm's)
waits for it. A second path saved at the same step with the same tensors right after (Lightning's
``last.ckpt`` after the top-k file) is written from the same snapshot. A failed background write is
raised (``on_error="stop"``) or warned about (``continue``) by the next ``save``/``load``/``wait``/``close``.

With ``full_every=K > 1`` up to K-1 saves in a row are deltas, each against the previous save when
that one is a sibling directory with another step and the same tensor layout (else a full one is
written). A checkpoint a delta builds on is kept on disk when the framework removes it, until the
last delta on it is removed too; saving over it is refused (it would break those deltas). Paths for
which ``base_ok(path)`` is false (Lightning's ``last.ckpt``, saved over every time) are never a base.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from .. import CheckpointWriteError, InvalidOptionError, SaveOptions, SaveStats
from ..api import write_tree
from ..dcp import Writer
from ..format import is_sibling_name
from ..write import DeltaBase, SavePipeline, Target
from ._bases import delete_checkpoint, dependents, recorded_base
from ._tree import ObjectTypes, encode_tree, read_tree


def refuse_memory(options: SaveOptions, plugin: str) -> None:
    """The memory tier (``SaveOptions.memory``) is the manager's and torchtitan's: where the framework
    names the checkpoint path to load (Lightning, DeepSpeed, the HF Trainer), no resume could take a
    memory step, so asking for one is an error rather than a tier that is silently never used."""
    if options.memory is not None:
        raise InvalidOptionError("memory", options.memory,
                                 f"the memory tier is not available with {plugin}, whose resume loads the path the "
                                 "framework names (a memory step has none); use ckpt.CheckpointManager or the "
                                 "torchtitan plug-in (docs/ADOPTING.md)")


class PathStore:
    """See the module docstring. ``objects``: allow-listed classes kept by their attributes;
    ``stats``: the counters to add to (a plug-in's, kept across stores)."""

    def __init__(self, options: SaveOptions | None = None, *, objects: ObjectTypes | None = None,
                 base_ok: Callable[[str], bool] | None = None, stats: SaveStats | None = None, **fields: Any):
        self.options = (options or SaveOptions()).replace(**fields)
        if self.options.replicas:
            raise InvalidOptionError("replicas", self.options.replicas,
                                     "are not supported by path-based plug-ins (use a CheckpointManager root)")
        refuse_memory(self.options, "a path-based plug-in (Lightning, DeepSpeed)")
        self.objects = objects or {}
        self.base_ok = base_ok or (lambda path: True)
        self._pipeline = SavePipeline(self.options, stats=stats)
        self._pipeline.attach_everywhere()  # a framework hands us a dict, not its model and optimizers
        self._bases: dict[str, str] = {}  # delta path -> base path, for deltas written by this store
        self._removed: set[str] = set()  # removed by the framework, kept while a delta builds on them
        self._closed = False

    @property
    def stats(self) -> SaveStats:
        """``saves``, ``deltas``, ``skipped``, ``failures``; ``stall_s``: time training was blocked by saves."""
        return self._pipeline.stats

    # -- the plug-in's calls ---------------------------------------------------------------------
    def save(self, tree: dict, path: str | os.PathLike, *, step: int | None = None, run: str | None = None) -> None:
        """``run``: the run identity recorded in the manifest (which checkpoints may stand in for another)."""
        self._check_open()
        start = time.perf_counter()
        path = os.path.abspath(os.fspath(path))
        on_it = [d for d, b in self._bases.items() if b == path and d not in self._removed]
        if on_it:
            raise CheckpointWriteError(f"{path} is the base of the delta checkpoint(s) {on_it}; saving over it "
                                       "would break them (use full_every=1, or a file name with the step)", path=path)
        self._pipeline.wait_for(path)
        started = self._pipeline.save(self._target(path, step, run), encode_tree(tree, self.objects),
                                      since=start, stacklevel=3)
        if started is not None:
            self._bases.pop(path, None)
            if started.base is not None:
                self._bases[path] = started.base

    def load(self, path: str | os.PathLike, *, map_tensor: Callable | None = None) -> dict:
        """The tree saved at ``path`` (any checkpoint of ours: a manager's step too)."""
        self._check_open()
        path = os.path.abspath(os.fspath(path))
        self._pipeline.wait_for(path)
        self._pipeline.raise_failures(stacklevel=3)
        return read_tree(path, objects=self.objects, map_tensor=map_tensor)

    def remove(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path`` (kept while a retained delta builds on it)."""
        self._check_open()
        path = os.path.abspath(os.fspath(path))
        self._pipeline.wait_for(path)
        self._pipeline.forget(path)  # no later save builds on it
        self._removed.add(path)
        self._collect(path)

    def wait(self) -> None:
        """Block until every started save is committed; raise the first background error."""
        self._pipeline.wait(stacklevel=3)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._pipeline.close(stacklevel=3)
        finally:
            self._closed = True

    # -- internals ---------------------------------------------------------------------------------
    def _target(self, path: str, step: int | None, run: str | None) -> Target:
        """Where the pipeline writes ``path``. A delta beside it records it by its plain sibling name
        (letters, digits, ".", "_", "-"); one ``base_ok`` refuses is never a base."""
        folder, name = os.path.split(path)
        named = self.base_ok(path) and is_sibling_name(name)
        return Target(path, step, lambda tree, base: self._write(tree, path, step, base, run),
                      folder=folder, name=name if named else None)

    def _write(self, flat: dict, path: str, step: int | None, base: DeltaBase | None, run: str | None) -> None:
        writer = Writer(path, overwrite=True, step=step, base=base, options=self.options)
        writer.run = run
        write_tree(flat, writer, process_group=None, no_dist=True)

    def _collect(self, path: str) -> None:
        """Delete ``path`` unless a delta on disk builds on it; then its base, if the framework removed
        that one already and nothing else builds on it."""
        while path in self._removed and not dependents(path):
            base = self._bases.pop(path, None) or recorded_base(path)
            delete_checkpoint(path)
            self._removed.discard(path)
            if base is None:
                return
            path = base

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the checkpoint store is closed")

"""Checkpoints at paths a framework chooses: the engine behind a path-based plug-in.

    store = PathStore(full_every=4)            # SaveOptions fields: async_mode, policy, full_every,
    store.save(tree, "ckpts/epoch=0-step=10.ckpt", step=10)    # compress, files_per_rank, ...
    tree = store.load("ckpts/epoch=0-step=10.ckpt")            # waits for that path's write first
    store.remove("ckpts/epoch=0-step=10.ckpt")
    store.close()

Lightning's ``CheckpointIO`` and DeepSpeed's ``CheckpointEngine`` are told "write this dict to this
path", "read that path", "delete that path"; which checkpoints exist is the framework's business
(``save_top_k``, its ``latest`` file). Each path becomes one committed checkpoint directory of ours
(:mod:`ckpt._tree` layout: tensors as tensors, the rest pickle-free), written atomically with
checksums, from this process alone.

With ``async_mode="double_buffer"`` (the default) ``save`` snapshots the tree into one of the two
reusable host buffer sets of a :class:`~ckpt.DoubleBufferStager` and returns; one background
thread writes. Until the snapshot copy is complete, the next ``optimizer.step()`` of any optimizer
(and the next module forward, for buffers such as BatchNorm's) waits for it. A failed background
write is raised by the next ``save``/``wait``/``close``.

With ``full_every=K > 1`` up to K-1 saves in a row are deltas, each against the previous save when
that one is a sibling directory with another step and the same tensor layout (else a full one is
written). A checkpoint a delta builds on is kept on disk when the framework removes it, until the
last delta on it is removed too; saving over it is refused (it would break those deltas). Paths for
which ``base_ok(path)`` is false (Lightning's ``last.ckpt``, saved over every time) are never a base.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import (
    AsyncMode,
    CheckpointError,
    CheckpointWriteError,
    DeltaBase,
    DoubleBufferStager,
    InvalidOptionError,
    SaveOptions,
)
from ..dcp import Writer
from ._bases import delete_checkpoint, dependents, recorded_base
from ._tree import ObjectTypes, encode_tree, read_tree

log = logging.getLogger(__name__)


@dataclass
class StoreStats:
    """``saves``; ``stall_s``: time the training thread was blocked by saves (inside ``save`` and
    waiting for a snapshot copy before the state changed); ``last_stall_s``; ``deltas`` written."""

    saves: int = 0
    deltas: int = 0
    stall_s: float = 0.0
    last_stall_s: float = 0.0


@dataclass
class _Written:
    path: str
    step: int | None
    snapshot: Future | None  # the staged tree (async mode), a delta's base state
    signature: tuple
    chain: int  # saves since the last full one


class PathStore:
    """See the module docstring. ``objects``: allow-listed classes kept by their attributes."""

    def __init__(self, options: SaveOptions | None = None, *, objects: ObjectTypes | None = None,
                 base_ok: Callable[[str], bool] | None = None, stats: StoreStats | None = None, **fields: Any):
        self.options = (options or SaveOptions()).replace(**fields)
        if self.options.replicas:
            raise InvalidOptionError("replicas", self.options.replicas,
                                     "are not supported by path-based plug-ins (use a CheckpointManager root)")
        self.objects = objects or {}
        self.base_ok = base_ok or (lambda path: True)
        self.stats = stats if stats is not None else StoreStats()  # a plug-in's, kept across stores
        self._async = self.options.async_mode is AsyncMode.DOUBLE_BUFFER
        self._stager = DoubleBufferStager(self.options.device_type, policy=self.options.policy) if self._async else None
        self._writer = (ThreadPoolExecutor(1, thread_name_prefix="ckpt-integration", initializer=_one_aten_thread)
                        if self._async else None)
        self._lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._errors: list[BaseException] = []
        self._last: _Written | None = None
        self._bases: dict[str, str] = {}  # delta path -> base path, for deltas written by this store
        self._removed: set[str] = set()  # removed by the framework, kept while a delta builds on them
        self._failed: set[str] = set()  # paths whose last write failed
        self._snapshot_pending = False
        self._forward_hook = None
        self._step_hook = register_optimizer_step_pre_hook(self._before_change)
        self._closed = False

    # -- the plug-in's calls ---------------------------------------------------------------------
    def save(self, tree: dict, path: str | os.PathLike, *, step: int | None = None, run: str | None = None) -> None:
        """``run``: the run identity recorded in the manifest (which checkpoints may stand in for another)."""
        self._check_open()
        self._raise_background_error()
        path = os.path.abspath(os.fspath(path))
        start = time.perf_counter()
        dependents = [d for d, b in self._bases.items() if b == path and d not in self._removed]
        if dependents:
            raise CheckpointWriteError(f"{path} is the base of the delta checkpoint(s) {dependents}; saving over it "
                                       "would break them (use full_every=1, or a file name with the step)", path=path)
        self._wait_path(path)
        flat = encode_tree(tree, self.objects)
        signature = _signature(flat)
        base = self._delta_base(path, step, signature)
        if not self._async:
            self._write(flat, path, step, None, run)
            self._record(path, step, None, signature, base)
        elif self._is_twin(path, step, signature):  # a second path for the same state (last.ckpt)
            written = Future()
            self._stager.track(written)  # the snapshot's buffer set stays busy until this write too
            future = self._writer.submit(self._persist_twin, self._last.snapshot, flat, path, step, run)
            future.add_done_callback(lambda f: self._finished(path, f, written))
            with self._lock:
                self._pending[path] = future
            self._bases.pop(path, None)
            self._failed.discard(path)
        else:
            written: Future = Future()
            snapshot = self._stager.stage(flat, keep_previous=base is not None, release=written, signature=signature)
            self._arm_wait()
            future = self._writer.submit(self._persist, snapshot, path, step, base, run)
            future.add_done_callback(lambda f: self._finished(path, f, written))
            with self._lock:
                self._pending[path] = future
            self._record(path, step, snapshot, signature, base)
        stall = time.perf_counter() - start
        self.stats.saves += 1
        self.stats.stall_s += stall
        self.stats.last_stall_s = stall

    def load(self, path: str | os.PathLike, *, map_tensor: Callable | None = None) -> dict:
        """The tree saved at ``path`` (any checkpoint of ours: a manager's step too)."""
        self._check_open()
        path = os.path.abspath(os.fspath(path))
        self._wait_path(path)
        self._raise_background_error()
        return read_tree(path, objects=self.objects, map_tensor=map_tensor)

    def remove(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path`` (kept while a retained delta builds on it)."""
        self._check_open()
        path = os.path.abspath(os.fspath(path))
        self._wait_path(path)
        self._removed.add(path)
        self._collect(path)

    def wait(self) -> None:
        """Block until every started save is committed; raise the first background error."""
        with self._lock:
            pending = list(self._pending.values())
        wait_futures(pending)  # their errors are recorded by _finished
        self._before_change()
        self._raise_background_error()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._step_hook.remove()
            if self._forward_hook is not None:
                self._forward_hook.remove()
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()

    # -- saving ------------------------------------------------------------------------------------
    def _delta_base(self, path: str, step: int | None, signature: tuple) -> DeltaBase | None:
        last = self._last
        if (self.options.full_every <= 1 or last is None or last.snapshot is None or last.chain + 1 >= self.options.full_every
                or last.signature != signature or last.path == path or last.step is None or step is None
                or last.step == step or os.path.dirname(last.path) != os.path.dirname(path)
                or last.path in self._removed or not self.base_ok(last.path)):
            return None
        try:  # the format names a base by a plain sibling name: letters, digits, ".", "_", "-"
            return DeltaBase(last.step, os.path.basename(last.path), last.snapshot)  # state: resolved by _persist
        except InvalidOptionError:
            return None

    def _record(self, path: str, step: int | None, snapshot: Future | None, signature: tuple,
                base: DeltaBase | None) -> None:
        chain = 0 if base is None else self._last.chain + 1
        self._last = _Written(path, step, snapshot, signature, chain)
        self._bases.pop(path, None)
        self._failed.discard(path)
        if base is not None:
            self._bases[path] = os.path.join(os.path.dirname(path), base.name)
            self.stats.deltas += 1

    def _is_twin(self, path: str, step: int | None, signature: tuple) -> bool:
        """Whether this save holds the state the last one snapshotted (same step, same tensors):
        Lightning saves ``last.ckpt`` right after the top-k file, with no training in between."""
        last = self._last
        return (last is not None and last.snapshot is not None and step is not None and last.step == step
                and last.path != path and last.signature == signature and last.path not in self._failed)

    def _persist_twin(self, snapshot: Future, flat: dict, path: str, step: int | None, run: str | None) -> None:
        staged = snapshot.result()
        tree = {k: staged[k] if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
        self._write(tree, path, step, None, run)

    def _persist(self, snapshot: Future, path: str, step: int | None, base: DeltaBase | None, run: str | None) -> None:
        if base is not None and os.path.join(os.path.dirname(path), base.name) in self._failed:
            base = None  # a delta never builds on a failed write
        if base is not None:
            base = DeltaBase(base.step, base.name, base.state.result())
        self._write(snapshot.result(), path, step, base, run)

    def _write(self, flat: dict, path: str, step: int | None, base: DeltaBase | None, run: str | None) -> None:
        writer = Writer(path, overwrite=True, step=step, base=base, options=self.options)
        writer.run = run
        try:
            dcp.save(flat, storage_writer=writer, no_dist=True)
        except CheckpointException as exc:
            writer.abort()
            failures = [pair[0] for _, pair in sorted(exc.failures.items())]
            error = next((f for f in failures if isinstance(f, CheckpointError)), failures[0] if failures else exc)
            if isinstance(error, CheckpointError):
                raise error from None
            raise CheckpointWriteError(f"saving {path} failed: {type(error).__name__}: {error}", path=path) from error

    def _finished(self, path: str, future: Future, written: Future) -> None:
        with self._lock:
            if self._pending.get(path) is future:
                del self._pending[path]
        error = future.exception()
        if error is not None:
            self._errors.append(error)
            self._failed.add(path)
            if self._last is not None and self._last.path == path:
                self._last = None  # nothing builds on a failed write
        written.set_result(None)

    # -- waiting before the live state changes -------------------------------------------------------
    def _arm_wait(self) -> None:
        self._snapshot_pending = True
        if self._forward_hook is None:
            self._forward_hook = register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, *_: Any) -> None:
        self._before_change()
        if self._forward_hook is not None:  # the hooks are copied before they run: removing is safe
            self._forward_hook.remove()
            self._forward_hook = None

    def _before_change(self, *_: Any) -> None:
        if not self._snapshot_pending:
            return
        start = time.perf_counter()
        self._stager.wait_snapshot()
        self._snapshot_pending = False
        waited = time.perf_counter() - start
        self.stats.stall_s += waited
        self.stats.last_stall_s += waited

    # -- internals ---------------------------------------------------------------------------------
    def _wait_path(self, path: str) -> None:
        with self._lock:
            future = self._pending.get(path)
        if future is not None:
            wait_futures([future])

    def _collect(self, path: str) -> None:
        """Delete ``path`` unless a delta on disk builds on it; then its base, if the framework removed
        that one already and nothing else builds on it."""
        while path in self._removed and not dependents(path):
            base = self._bases.pop(path, None) or recorded_base(path)
            delete_checkpoint(path)
            self._removed.discard(path)
            if self._last is not None and self._last.path == path:
                self._last = None
            if base is None:
                return
            path = base

    def _raise_background_error(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            if not isinstance(error, CheckpointError):
                wrapped = CheckpointWriteError(f"a checkpoint write failed: {type(error).__name__}: {error}")
                wrapped.__cause__, error = error, wrapped
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the checkpoint store is closed")


def _one_aten_thread() -> None:
    """A worker thread's ATen ops run single-threaded: a long-lived thread that starts an OpenMP team
    of its own makes every later parallel region of the training thread slower (bench_trainer.py)."""
    torch.set_num_threads(1)


def _signature(flat: dict) -> tuple:
    """Shapes and dtypes of the tensors in order: the staging buffers' layout. Names may differ (Lightning's
    ``best_k_models`` scores are keyed by path); a delta chunk without a same-named base chunk is stored whole."""
    return tuple((tuple(v.shape), v.dtype) for v in flat.values() if isinstance(v, torch.Tensor))

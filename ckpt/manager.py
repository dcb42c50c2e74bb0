"""CheckpointManager: periodic, asynchronous, retained checkpoints of a training run under one root.

    manager = CheckpointManager("ckpts", interval=100, keep=3)
    manager.attach(optimizer)               # snapshot copies finish before the next optimizer step
    start = manager.load(state) or 0       # latest committed step, or None
    for step in range(start + 1, steps + 1):
        train_step()
        manager.save(step, state)           # returns at once; bytes are written in the background
    manager.close()                         # waits; raises any background error

Layout: ``<root>/step-00000100/`` per step (the format of docs/FORMAT.md). One manager per root:
rank 0 holds ``<root>/.lock`` and, at start-up, deletes what dead saves left (tmp dirs,
manifest-less step dirs). ``save`` captures small values synchronously, starts the tensor snapshot
into a free staging buffer set (:class:`~ckpt.staging.DoubleBufferStager`) and queues the write on
one background thread that uses its own gloo process group, so its collectives never interleave
with training's. After each commit, rank 0 applies retention (:mod:`ckpt.retention`). A background
failure is raised by the next ``save``/``wait``/``close``. ``async_mode="sync"`` writes inside
``save`` instead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import commit, retention
from .api import load as load_checkpoint, write_tree
from .dcp import Writer
from .errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from .format import MANIFEST_NAME
from .options import Compression, SaveOptions
from .chain import read_manifest
from .staging import DoubleBufferStager, single_threaded_aten, tensor_signature
from .state import export_state

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d{8,})$")
ASYNC_MODES = ("double_buffer", "sync")


def step_path(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def committed_steps(root: str | os.PathLike) -> list[int]:
    """Steps with a committed checkpoint under ``root``, ascending (the manifests are the truth)."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and (entry / MANIFEST_NAME).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


@dataclass
class SaveStats:
    """Counters of a manager. A save's *stall* is the time the training thread was blocked by it:
    inside ``save()`` plus any wait for its snapshot before the next optimizer step."""

    saves: int = 0
    skipped: int = 0
    stall_s: float = 0.0
    last_stall_s: float = 0.0
    host_buffer_bytes: int = 0


class CheckpointManager:
    """Periodic checkpoints of one run under ``root`` (see the module docstring).

    Args:
        root: directory holding ``step-XXXXXXXX/`` checkpoints.
        interval: ``save(step, ...)`` writes when ``step % interval == 0`` (or ``force=True``).
        keep: newest committed steps to keep; ``keep_every``: also keep multiples of it.
        async_mode: "double_buffer" (default) or "sync".
        full_every: K > 1 writes a full checkpoint, then up to K-1 deltas, each against the previous
            snapshot (kept in the other staging buffer set: no extra copy); a change of layout or
            dtype, or a failed write, starts a new full. Needs async_mode "double_buffer".
        compress: "zstd" stores full checkpoints as zstd byte planes (deltas always are); None: raw.
        zstd_level: zstd level for deltas and compressed fulls.
        policy: when both staging buffer sets are busy: "block" (default) or "skip" the save.
        device_type: "cuda"/"npu"/"cpu" for staging (default: the accelerator in use, else cpu).
        files_per_rank, user_metadata: passed to the writer.

    Collective: every rank constructs it, and calls ``save``/``load``/``close`` in the same order.
    """

    def __init__(self, root: str | os.PathLike, options: SaveOptions | None = None, **overrides: Any):
        options = (options or SaveOptions()).replace(**overrides)
        self.options = options
        self.root = Path(root)
        self.interval, self.keep, self.keep_every = options.interval, options.keep, options.keep_every
        self.async_mode, self.policy = options.async_mode.value, options.policy.value
        self.files_per_rank, self.user_metadata = options.files_per_rank, options.user_metadata
        self.full_every, self.zstd_level = options.full_every, options.zstd_level
        self.compress = None if options.compress is Compression.NONE else options.compress.value
        device_type = options.device_type
        self._previous: tuple[int, Future, tuple] | None = None  # (step, staged snapshot, signature)
        self._deltas_in_chain = 0
        self._chain_broken = False
        self._bases: dict[int, int | None] = {}  # step -> base step, for retention
        self.stats = SaveStats()
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        # Background writes and the main thread's agreements each get their own gloo group.
        self._control_pg = dist.new_group(backend="gloo") if self._distributed else None
        self._write_pg = dist.new_group(backend="gloo") if self._distributed else None
        self._lock_fd: int | None = None
        self._agree_or_raise(self._take_root)
        self._stager = DoubleBufferStager(device_type, policy=self.policy) if self.async_mode == "double_buffer" else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist", initializer=single_threaded_aten)
        self._inflight: dict[int, Future] = {}
        self._errors: list[BaseException] = []
        self._hooks: list[Any] = []
        self._closed = False

    # -- training-loop API -----------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Wait for a pending snapshot right before ``optimizer.step()`` (the first moment
        parameters change). Custom loops without an optimizer call :meth:`before_step` instead."""
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.before_step()))

    def before_step(self) -> None:
        """Block until the last snapshot no longer needs the live tensors (on an accelerator:
        order the compute stream after the copy, without blocking the host)."""
        if self._stager is None:
            return
        start = time.perf_counter()
        self._stager.wait_snapshot()
        waited = time.perf_counter() - start
        self.stats.stall_s += waited
        self.stats.last_stall_s += waited

    def save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        """Checkpoint ``state`` as ``step`` if due (``step % interval == 0``) or forced.

        Returns whether a save was started. Returns before the bytes are on disk (async mode)."""
        self._check_open()
        self._raise_background_error()
        if not force and step % self.interval:
            return False
        start = time.perf_counter()
        if self._stager is not None:
            self._stager.wait_snapshot()  # the previous snapshot must be complete before the next one
        tree, _ = export_state(state)
        if self._stager is None:
            self._write(step, tree)
            self._after_commit(step)
            self._account(start)
            return True
        if self.policy == "skip" and self._agree_any(not self._stager.has_free_set()):
            self.stats.skipped += 1
            warnings.warn(f"checkpoint of step {step} skipped: both staging buffers are still being written",
                          stacklevel=2)
            return False
        signature = tensor_signature(tree)
        base = self._delta_base(signature)
        snapshot = self._stager.stage(tree, keep_previous=base is not None)
        future = self._writer.submit(self._persist, step, snapshot, base)
        self._stager.track(future)
        self._previous = (step, snapshot, signature)
        self._deltas_in_chain = 0 if base is None else self._deltas_in_chain + 1
        self._bases[step] = None if base is None else base[0]
        self._inflight[step] = future
        future.add_done_callback(lambda f, step=step: self._finished(step, f))
        self.stats.host_buffer_bytes = self._stager.host_bytes
        self._account(start)
        return True

    def wait(self) -> None:
        """Block until every started save is committed; raise the first background error."""
        for future in list(self._inflight.values()):
            try:
                future.result()
            except BaseException:
                pass  # recorded by _finished; raised below
        if self._stager is not None:
            self._stager.wait_snapshot(host=True)
        self._raise_background_error()

    def load(self, state: dict[str, Any], step: int | None = None, *, strict: bool = True) -> int | None:
        """Load ``step`` (default: the latest committed step) into ``state``; return the step loaded,
        or None when there is no checkpoint. Without an explicit step, an unreadable latest
        checkpoint is reported and the next older one is tried."""
        self._check_open()
        self.wait()
        if step is not None:
            load_checkpoint(state, step_path(self.root, step), strict=strict, process_group=self._control_pg)
            return step
        for candidate in reversed(self.steps()):
            try:
                load_checkpoint(state, step_path(self.root, candidate), strict=strict, process_group=self._control_pg)
                return candidate
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                log.warning("checkpoint step %d cannot be loaded (%s); trying an older one", candidate, exc)
                warnings.warn(f"checkpoint step {candidate} cannot be loaded ({exc}); falling back", stacklevel=2)
        return None

    def steps(self) -> list[int]:
        """Committed steps under the root, ascending."""
        return committed_steps(self.root)

    def close(self) -> None:
        """Wait for every save, free the staging buffers, release the root. Raises a background error."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for hook in self._hooks:
                hook.remove()
            if self._stager is not None:
                self._stager.close()
            self._writer.shutdown(wait=True)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            for group in (self._control_pg, self._write_pg):
                if group is not None:
                    dist.destroy_process_group(group)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: do not hide that error behind a background one
            self.close()
        except CheckpointError as background:
            log.error("checkpoint error while closing after a failure: %s", background)

    # -- internals ---------------------------------------------------------------------------------
    def _take_root(self) -> None:
        """Rank 0: lock the root and clear what dead saves left behind."""
        if self.rank != 0:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointLockedError(f"another CheckpointManager is writing to {self.root}") from None
        self._lock_fd = fd
        commit.collect_root_garbage(self.root)
        for entry in self.root.iterdir():
            if STEP_DIR.match(entry.name) and entry.is_dir() and not (entry / MANIFEST_NAME).exists():
                log.info("removing %s: no manifest (an interrupted deletion)", entry)
                commit.delete(entry)

    def _agree_or_raise(self, fn) -> None:
        """Run ``fn`` (which may raise on rank 0 only) and make every rank raise the same error."""
        error = None
        try:
            fn()
        except CheckpointError as exc:
            error = exc
        if self._distributed:
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self._control_pg)
            error = box[0]
        if error is not None:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise error

    def _agree_any(self, flag: bool) -> bool:
        if not self._distributed:
            return flag
        tensor = torch.tensor([int(flag)])
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control_pg)
        return bool(tensor.item())

    def _delta_base(self, signature: tuple) -> tuple[int, Future] | None:
        """(base step, its staged snapshot) when this save may be a delta; agreed by every rank."""
        eligible = (
            self.full_every > 1 and self._previous is not None and not self._chain_broken
            and self._deltas_in_chain < self.full_every - 1 and self._previous[2] == signature
        )
        if self._agree_any(not eligible):
            self._chain_broken = False  # this save starts a new chain
            return None
        return self._previous[0], self._previous[1]

    def _write(self, step: int, tree: dict, base: tuple[int, dict] | None = None) -> None:
        writer = Writer(step_path(self.root, step), overwrite=True, files_per_rank=self.files_per_rank,
                        step=step, user_metadata=self.user_metadata, compress=self.compress,
                        zstd_level=self.zstd_level,
                        base=None if base is None else base[1],
                        base_name=None if base is None else step_path(self.root, base[0]).name,
                        base_step=None if base is None else base[0])
        write_tree(tree, writer, process_group=self._write_pg, no_dist=not self._distributed)

    def _persist(self, step: int, snapshot: Future, base: tuple[int, Future] | None) -> None:
        self._write(step, snapshot.result(), None if base is None else (base[0], base[1].result()))
        self._after_commit(step)

    def _after_commit(self, step: int) -> None:
        if self.rank != 0:
            return
        in_flight = {s for s, f in self._inflight.items() if not f.done()} - {step}
        committed = self.steps()
        for known in committed:
            if known not in self._bases:  # written by an earlier run: ask its manifest
                try:
                    self._bases[known] = read_manifest(step_path(self.root, known)).base_step
                except CheckpointError:
                    self._bases[known] = None
        for old in retention.steps_to_delete(committed, keep=self.keep, keep_every=self.keep_every,
                                             protected=in_flight, bases=self._bases):
            log.info("retention: deleting step %d", old)
            commit.delete(step_path(self.root, old))

    def _finished(self, step: int, future: Future) -> None:
        self._inflight.pop(step, None)
        error = future.exception()
        if error is not None:
            self._errors.append(error)
            self._chain_broken = True  # a delta must never build on a write that failed

    def _raise_background_error(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointWriteError(f"a background checkpoint write failed: {type(error).__name__}: {error}") from error

    def _account(self, start: float) -> None:
        stall = time.perf_counter() - start
        self.stats.saves += 1
        self.stats.stall_s += stall
        self.stats.last_stall_s = stall

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")

"""The systems of the scaling benchmark, as its emulated accelerator job drives them, and that job's state.

The job (see ``bench_scaling``): a step is a sleep (the device computes; the host is free) then the
optimizer step, :func:`update`: an in-place ``add_(1)`` of every tensor of a model-like state. A
:class:`System` is one way to checkpoint that state: ``save`` and ``before_step`` (the wait before
the update) run on the training thread and are timed by the caller; ``durable_at[step]`` is the
``perf_counter`` time the save was committed, where the system tells; ``load`` reads a part of a
step back for the checks (:func:`equal_after_update`, on the whole state or on :func:`first_layer`).
The peers' library calls are ``peers``'; what a system counts as stall or durable is here.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness import remove  # first: puts this checkout's root on sys.path

import ckpt  # noqa: E402
import peers  # noqa: E402
from states import select, tensors, zeros_like  # noqa: E402

torchsnapshot = peers.torchsnapshot_module()  # an optional peer (the bench extra)


# ---------------------------------------------------------------------------------------------
# The state
# ---------------------------------------------------------------------------------------------
def update(state: dict) -> None:
    """The emulated optimizer step: every tensor changes in place."""
    for t in tensors(state):
        t.add_(1)


def equal_after_update(saved: Any, live: Any) -> bool:
    """Whether ``saved`` is ``live`` as it was one update ago (the run ends with one after the last save)."""
    if isinstance(live, torch.Tensor):
        return isinstance(saved, torch.Tensor) and saved.shape == live.shape and torch.equal(saved + 1, live)
    return isinstance(saved, dict) and saved.keys() == live.keys() and all(
        equal_after_update(saved[k], live[k]) for k in live)


def first_layer(state: dict) -> dict:
    """The subtree of layer 0 (weight, bias and their optimizer state): a spot check's target."""
    return {"model": {k: v for k, v in state["model"].items() if k.startswith("layers.0.")},
            "optim": {"state": {k: v for k, v in state["optim"]["state"].items() if k.startswith("layers.0.")}}}


# ---------------------------------------------------------------------------------------------
# Systems
# ---------------------------------------------------------------------------------------------
@dataclass
class Ctx:
    rank: int = 0
    world: int = 1
    distributed: bool = False  # a process group is initialized (the ranks axis)


class System:
    """One way to checkpoint. ``save`` and ``before_step`` run on the training thread (timed);
    ``durable_at[step]`` is the ``perf_counter`` time the save was committed, where known."""

    key = label = note = ""
    writes = True

    def __init__(self, state: dict, work: Path, ctx: Ctx):
        self.state, self.work, self.ctx = state, work, ctx
        self.durable_at: dict[int, float] = {}
        self.tells_durable = self.writes  # whether durable_at gets filled on this rank
        self.parts: dict[str, float] = {}  # the last save's named parts (training thread)
        self.dirs: dict[int, Path] = {}  # step -> its directory, for systems that save one per step

    def setup(self) -> None:
        pass

    def save(self, step: int) -> float | None:
        """Save ``step``; may return the seconds to count instead of the wall time of the call."""
        raise NotImplementedError

    def before_step(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def prune(self, keep_from: int) -> None:
        """Delete finished saves older than ``keep_from`` (outside the timing; keeps the disk small):
        by default the step directories in ``dirs`` (one for all ranks, deleted by rank 0)."""
        for step in [s for s in self.dirs if s < keep_from and s in self.durable_at]:
            path = self.dirs.pop(step)
            if self.ctx.rank == 0:
                shutil.rmtree(path, ignore_errors=True)

    def load(self, step: int, template: dict) -> Any:
        """The part of ``step`` that ``template`` (a subtree of the state) names, loaded back (for the
        check outside the timing)."""
        raise NotImplementedError

    def host_bytes(self) -> int | None:
        """Host memory the system keeps for staging, where it says."""
        return None

    def close(self) -> None:
        pass


class BareCopy(System):
    key, label, writes = "copy", "bare copy", False
    note = ("`copy_` of every tensor into preallocated, faulted-in buffers: the limit when the copy is not "
            "overlapped. Each save copies twice, with the process's intra-op threads and with one, and counts the "
            "faster (under other load a 2-thread copy waits for its slower thread; the faster one is the stricter "
            "reference for the ratios)")

    def setup(self) -> None:
        self.copier = peers.BareCopy(tensors(self.state))

    def copy(self) -> float:
        start = time.perf_counter()
        self.copier.copy(tensors(self.state))
        return time.perf_counter() - start

    def save(self, step: int) -> float:
        """The faster of a copy with the process's intra-op threads and one with a single thread:
        under other load a multi-threaded copy waits for its slowest thread, which would inflate
        the reference (and flatter every ratio to it)."""
        threads = torch.get_num_threads()
        self.parts = {f"{threads} threads": self.copy()}
        if threads > 1:
            torch.set_num_threads(1)
            try:
                self.parts["1 thread"] = self.copy()
            finally:
                torch.set_num_threads(threads)
        return min(self.parts.values())


class Ours(System):
    key, label = "ours", "ours"
    note = ("`CheckpointManager(dir, interval=1)`, default async `double_buffer`: `save()` + the wait in "
            "`before_step()` (the optimizer pre-hook of `attach`); durable at `on_commit`")

    def setup(self) -> None:
        self.manager = ckpt.CheckpointManager(self.work / "ours", interval=1, on_commit=self._committed)
        self.tells_durable = self.ctx.rank == 0  # on_commit runs on the coordinator only

    def _committed(self, info) -> None:
        self.durable_at[info.step] = time.perf_counter()

    def save(self, step: int) -> None:
        self.manager.save(step, self.state, force=True)

    def before_step(self) -> None:
        self.manager.before_step()

    def drain(self) -> None:
        self.manager.wait()

    def load(self, step: int, template: dict) -> Any:
        target = zeros_like(template)
        # Part of the state (or a rank's own shards): the checkpoint's other keys are expected.
        self.manager.load(target, step=step, strict=False)
        return target

    def host_bytes(self) -> int | None:
        return self.manager.stats.host_buffer_bytes

    def close(self) -> None:
        self.manager.close()


class DCPDefault(System):
    key, label = "dcp-default", "DCP async_save (default stager)"
    note = ("`async_stager=None`: `FileSystemWriter` stages (a fresh copy inside the call); + the wait for the "
            "previous upload (one `async_save` in flight); durable when the upload future is done (fsync'd)")
    stager = "default"

    def setup(self) -> None:
        # DCP's upload thread runs collectives: give it a group of its own, as the docs advise.
        self.pg = dist.new_group(backend="gloo") if self.ctx.distributed else None
        self.dcp = peers.DCPAsyncSave(self.stager, process_group=self.pg, no_dist=not self.ctx.distributed)

    def save(self, step: int) -> None:
        waited = self.dcp.wait_previous()
        path = self.dirs[step] = self.work / self.key / f"step-{step:06d}"
        self.dcp.save(self.state, path, on_done=lambda t, s=step: self.durable_at.__setitem__(s, t))
        self.parts = {"wait previous": waited}

    def before_step(self) -> None:
        self.dcp.wait_staged()

    def drain(self) -> None:
        self.dcp.drain()

    def load(self, step: int, template: dict) -> Any:
        target = zeros_like(template)
        peers.dcp_load(target, self.dirs[step], process_group=self.pg, no_dist=not self.ctx.distributed)
        return target

    def close(self) -> None:
        self.dcp.close()


class DCPCaching(DCPDefault):
    key, label = "dcp-caching", "DCP async_save (caching stager)"
    note = ("`DefaultStager(StagingOptions(False, False, True, False))`: cached staging storages, copy on a "
            "background thread; + the wait for `staging_completion` before the update and for the previous upload")
    stager = "caching"


class TorchSave(System):
    key, label = "torch-save", "torch.save"
    note = "`torch.save(state, file)` + `fsync`, synchronous (one file per rank)"

    def path(self, step: int) -> Path:
        return self.work / self.key / f"step-{step:06d}-rank{self.ctx.rank}.pt"

    def setup(self) -> None:
        (self.work / self.key).mkdir(parents=True, exist_ok=True)

    def save(self, step: int) -> None:
        peers.torch_save(self.state, self.path(step))
        self.durable_at[step] = time.perf_counter()

    def prune(self, keep_from: int) -> None:
        for step in [s for s in self.durable_at if s < keep_from]:
            remove(self.path(step))

    def load(self, step: int, template: dict) -> Any:
        return select(torch.load(self.path(step), weights_only=True, mmap=True), template)


class TorchSnapshot(System):
    key, label = "torchsnapshot", "torchsnapshot"
    note = ("`Snapshot.async_take` + the wait for the previous one; durable at `done()` (metadata written; its file "
            "plug-in does not fsync). `async_take` returns once its write requests are staged: tensors under its "
            "128 MiB slab threshold are batched (copied) into slabs, but in 0.1.0 a larger CPU tensor is not cloned "
            "(`TensorBufferStager._should_copy_cpu_tensor` compares the entry's serializer string with an Enum member), "
            "so from 3 GiB of this state up (tensors of > 128 MiB) it returns without a snapshot; check 2 below "
            "catches that")

    def setup(self) -> None:
        if torchsnapshot is None:
            raise RuntimeError("torchsnapshot is not installed (pip install torchsnapshot)")
        self.snapshot = peers.SnapshotAsyncTake()

    def save(self, step: int) -> None:
        waited = self.snapshot.wait_previous()
        path = self.dirs[step] = self.work / self.key / f"step-{step:06d}"
        self.snapshot.take(path, {"state": torchsnapshot.StateDict(self.state)},
                           on_done=lambda t, s=step: self.durable_at.__setitem__(s, t))
        self.parts = {"wait previous": waited}

    def drain(self) -> None:
        self.snapshot.drain()

    def load(self, step: int, template: dict) -> Any:
        """Entry by entry (``restore`` would read every entry, whatever the target holds)."""
        snapshot = torchsnapshot.Snapshot(str(self.dirs[step]))

        def read(node: Any, path: tuple) -> Any:
            if isinstance(node, dict):
                return {k: read(v, path + (k,)) for k, v in node.items()}
            return snapshot.read_object("/".join((str(self.ctx.rank), "state", *path)), obj_out=torch.zeros_like(node))

        return read(template, ())


SYSTEMS = {s.key: s for s in (BareCopy, Ours, DCPDefault, DCPCaching, TorchSave, TorchSnapshot)}

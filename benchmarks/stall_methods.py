"""The methods the stall benchmark compares, each checkpointing the live model and optimizer of
``stall_loop``'s training job from its training thread (the peers' library calls are ``peers``').

Each fills the :class:`~stall_loop.SaveRecord` of its save: ``parts`` (where the save call's time
went, where known), ``pre_step_wait`` (what it waited inside ``optimizer.step()``: ours' pre-hook)
and ``durable`` (seconds from the save's start until it was committed; torchsnapshot: written).
Ours' breakdown wraps public engine functions by name (:class:`Timers`): the engine is not modified,
and a refactor that stops calling them drops those parts from the notes, never the benchmark.
"""

from __future__ import annotations

import time
from typing import Any

from torch.distributed.checkpoint.state_dict import get_state_dict

import harness  # noqa: F401  (first: puts this checkout's root on sys.path)
import ckpt  # noqa: E402
import ckpt.manager  # noqa: E402
import peers  # noqa: E402
from stall_loop import Method, SaveRecord  # noqa: E402

torchsnapshot = peers.torchsnapshot_module()  # an optional peer (the "bench" extra), skipped with a note when missing


class BareCopy(Method):
    name, key, label = "bare copy_ (limit, not overlapped)", "copy", "bare copy"
    note = "copy_ of every state tensor into preallocated buffers"

    def setup(self) -> None:
        self.copier = peers.BareCopy(self.trainer.state_tensors())

    def save(self, step: int, rec: SaveRecord) -> None:
        self.copier.copy(self.trainer.state_tensors())

    def close(self) -> None:
        self.copier.close()


class Timers:
    """Wrap functions to add their duration (training thread or not) to ``sink[name]``."""

    def __init__(self):
        self.sink: dict[str, float] = {}
        self.undo: list = []

    def wrap(self, owner: Any, attr: str, name: str, on_result=None) -> None:
        """Time ``owner.attr`` (a function, or a method when ``owner`` is a class); ``on_result(t0,
        result)`` is told each outermost call's start and result."""
        original = getattr(owner, attr)
        sink = self
        depth = [0]  # recursive functions count their outermost call only

        def timed(*a, **kw):
            if depth[0]:
                return original(*a, **kw)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                result = original(*a, **kw)
            finally:
                depth[0] -= 1
                sink.sink[name] = sink.sink.get(name, 0.0) + (time.perf_counter() - t0)
            if on_result is not None:
                on_result(t0, result)
            return result

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, original))

    def take(self) -> dict[str, float]:
        out, self.sink = self.sink, {}
        return out

    def restore(self) -> None:
        for owner, attr, original in reversed(self.undo):
            setattr(owner, attr, original)
        self.undo.clear()


class Ours(Method):
    name, key, label = "ckpt CheckpointManager (double_buffer)", "ours", "ours"
    note = "ours; save() + optimizer pre-hook wait"
    mode = "double_buffer"

    def setup(self) -> None:
        self.committed: dict[int, SaveRecord] = {}  # step -> its record, until on_commit says it is durable
        self.manager = ckpt.CheckpointManager(self.work / self.key, interval=1, async_mode=self.mode,
                                              on_commit=self._on_commit)
        self.manager.attach(self.trainer.opt)
        self.state = {"model": self.trainer.model, "optim": self.trainer.opt}
        self.copies: list[tuple[float, float]] = []  # background snapshot copies (stage() call, snapshot done)
        self.writes: list[float] = []  # CommitInfo.seconds: each write's start to its commit
        self.timers = Timers()
        # Instrumentation only, through public names (the engine is not modified): where the training
        # thread spends save(). The manager calls the public export_state / tensor_signature by these
        # names; a refactor that stops doing so drops those parts from the notes, never the benchmark.
        for name in ("export_state", "tensor_signature"):
            if callable(getattr(ckpt.manager, name, None)):
                self.timers.wrap(ckpt.manager, name, name)
        if self.mode != "sync":
            self.timers.wrap(ckpt.DoubleBufferStager, "stage", "stage()", on_result=self._track_copy)
        self._before = 0.0

    def _track_copy(self, t0: float, snapshot: Any) -> None:
        """``stage()`` returns a Future of the staged state: done when the background copy is."""
        if hasattr(snapshot, "add_done_callback"):
            snapshot.add_done_callback(lambda _f: self.copies.append((t0, time.perf_counter())))

    def _on_commit(self, info: ckpt.CommitInfo) -> None:
        self.writes.append(info.seconds)
        rec = self.committed.pop(info.step, None)
        if rec is not None:
            rec.durable = time.perf_counter() - rec.start

    def save(self, step: int, rec: SaveRecord) -> None:
        self.timers.take()
        self.committed[step] = rec
        self.manager.save(step, self.state, force=True)
        self._after_save = self.manager.stats.stall_s
        parts = self.timers.take()
        order = ["export_state", "tensor_signature", "stage()"]
        rec.parts = {k: parts[k] for k in order if k in parts}
        self._pending = rec
        if self.mode == "sync":
            rec.durable = None  # committed inside save()

    def after_step(self, rec: SaveRecord | None) -> None:
        if rec is not None:
            rec.pre_step_wait = self.manager.stats.stall_s - self._after_save
            rec.parts["manager stats.last_stall_s"] = self.manager.stats.last_stall_s

    def drain(self) -> None:
        self.manager.wait()

    def close(self) -> None:
        self.timers.restore()
        self.extra["steps committed"] = self.manager.steps()
        self.extra["host_buffer_bytes"] = self.manager.stats.host_buffer_bytes
        self.extra["skipped"] = self.manager.stats.skipped
        self.extra["write_s"] = list(self.writes)
        self.manager.close()

    def host_buffer_bytes(self) -> int | None:
        return self.manager.stats.host_buffer_bytes if self.mode != "sync" else None


class OursSync(Ours):
    name, key, label, mode = "ckpt CheckpointManager (sync)", "ours-sync", "ours (sync)", "sync"
    note = "ours; write + commit inside save()"


class DCPAsync(Method):
    name, key, label = "DCP async_save (default stager)", "dcp-default", "DCP async_save (default stager)"
    note = "async_stager=None: FileSystemWriter stages (fresh copy, in the call)"
    stager = "default"

    def setup(self) -> None:
        self.dcp = peers.DCPAsyncSave(self.stager)

    def save(self, step: int, rec: SaveRecord) -> None:
        waited = self.dcp.wait_previous()
        t1 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(self.trainer.model, self.trainer.opt)
        sd = {"model": model_sd, "optim": optim_sd}
        t2 = time.perf_counter()
        self.dcp.save(sd, self.work / self.key / f"step-{step:08d}",
                      on_done=lambda t, rec=rec: setattr(rec, "durable", t - rec.start))
        t3 = time.perf_counter()
        rec.parts = {"wait previous upload": waited, "get_state_dict": t2 - t1, "async_save()": t3 - t2}

    def before_step(self, rec: SaveRecord | None) -> None:
        self.dcp.wait_staged()

    def drain(self) -> None:
        self.dcp.drain()

    def close(self) -> None:
        self.extra["async_save returned"] = sorted(self.dcp.returned)
        self.dcp.close()


class DCPCaching(DCPAsync):
    name, key, label = "DCP async_save (caching DefaultStager)", "dcp-caching", "DCP async_save (caching stager)"
    note = "DefaultStager, cached storages, async staging thread"
    stager = "caching"


class TorchSave(Method):
    name, key, label = "torch.save + fsync", "torch-save", "torch.save"
    note = "synchronous"

    def save(self, step: int, rec: SaveRecord) -> None:
        (self.work / self.key).mkdir(parents=True, exist_ok=True)
        path = self.work / self.key / f"step-{step:08d}.pt"
        peers.torch_save({"model": self.trainer.model.state_dict(), "optim": self.trainer.opt.state_dict()}, path)


class TorchSnapshot(Method):
    name, key, label = "torchsnapshot Snapshot.async_take", "torchsnapshot", "torchsnapshot"
    note = "stages (copies) inside async_take, writes on its own thread; no fsync"
    fsyncs = False  # its FSStoragePlugin writes through aiofiles and never fsyncs

    def setup(self) -> None:
        self.snapshot = peers.SnapshotAsyncTake()

    def save(self, step: int, rec: SaveRecord) -> None:
        waited = self.snapshot.wait_previous()  # one snapshot in flight, as for DCP; the wait blocks training: stall
        t1 = time.perf_counter()
        app_state = {"model": self.trainer.model, "optim": self.trainer.opt}
        self.snapshot.take(self.work / self.key / f"step-{step:08d}", app_state,
                           on_done=lambda t, rec=rec: setattr(rec, "durable", t - rec.start))
        rec.parts = {"wait previous snapshot": waited, "async_take()": time.perf_counter() - t1}

    def drain(self) -> None:
        self.snapshot.drain()

    def close(self) -> None:
        self.drain()


METHODS = {m.key: m for m in (BareCopy, Ours, OursSync, DCPAsync, DCPCaching, TorchSave, TorchSnapshot)}

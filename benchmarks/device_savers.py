"""The savers the device checks compare, each behind one small interface, and what each one's
waits were.

A saver has ``save(step)`` (called right after an optimizer step, as a training loop does; every call saves),
``before_optimizer`` (the wait a loop makes before the next optimizer step, or None), ``drain()``
(every write finished), ``close()``, ``warm_saves`` (saves made and drained before anything is
timed: buffers allocated, processes started) and ``marks`` (name -> one value per save, in ms or s).

* :class:`Ours`: ``ckpt.CheckpointManager`` (pinned double buffer, side-stream copy, the wait in its
  optimizer pre-hook). Marks: ``copy_ms`` (events on the copy stream, :class:`device_job.CopyTimes`),
  ``compute_wait_ms`` (the compute stream's waits, events the engine records), ``host_stall_ms``.
* :class:`TitanCalls`: what torchtitan's ``CheckpointManager`` runs for
  ``async_mode="async_with_pinned_mem"`` (torchtitan 0.3, ``components/checkpointer/dcp.py``), call
  for call: the previous upload waited for (``maybe_wait_for_saving``), ``gc.collect(1)``, the model
  state dict and the flattened optimizer state dict, one ``DefaultStager(StagingOptions(True, True,
  True, True))``, ``dcp.async_save(..., process_group=<its own gloo group>,
  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)``, and the staging
  waited for before the next optimizer step (``maybe_wait_for_staging``). Without an accelerator
  (a dry run) ``use_non_blocking_copy`` is off: DCP refuses it there. Where /dev/shm cannot hold
  the staged copies that its checkpoint process reads (:func:`titan_cannot_run`), it is not run.
* :class:`TitanManager`: torchtitan's own ``CheckpointManager`` with its ``OptimizersContainer``
  (AdamW, foreach) over the job's model; ``async_with_pinned_mem`` on a device, ``async`` in a dry run.
* :class:`DCPDefault`: ``dcp.async_save`` with DCP's default staging (a copy inside the call) and its
  upload thread, one save in flight.

The DCP savers' marks keep the upload apart from the staging: ``upload_wait_ms`` (the next save
waiting for the previous upload: the drain), ``call_ms`` (inside the save call), ``staging_s``
(call -> staging complete), ``staging_wait_ms`` (before the optimizer step), ``upload_s`` (call ->
upload complete).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from pathlib import Path

from torch.distributed.checkpoint.staging import DefaultStager

from device_job import CopyTimes, Job
from device_setup import GIB, Context


class Marks(defaultdict):
    """name -> one value per save: milliseconds of a wait, or seconds until a future completed."""

    def __init__(self):
        super().__init__(list)

    def since(self, name: str, start: float, scale: float = 1e3) -> None:
        self[name].append(round(scale * (time.perf_counter() - start), 3))

    def when_done(self, name: str, future, start: float) -> None:
        """``name``: seconds from ``start`` until ``future`` completes (on the thread that completes
        it; into this record even when the saver has started a new one since)."""
        values = self[name]
        future.add_done_callback(lambda _f: values.append(round(time.perf_counter() - start, 3)))


class Ours:
    label = "ours: ckpt.CheckpointManager (pinned double buffer, side-stream copy)"
    warm_saves = 2  # back to back: the second allocates the other buffer set while the first is written
    before_optimizer = None  # the manager's optimizer pre-hook waits

    def __init__(self, ctx: Context, job: Job, root: Path):
        import ckpt

        self.ctx, self.job, self.marks = ctx, job, Marks()
        self.copies = CopyTimes(ctx)
        with self.copies.every_stager():
            self.manager = ckpt.CheckpointManager(root, interval=1, keep=1, device_type=ctx.device_type)
        self.manager.attach(job.opt)
        self.notes = {}

    def save(self, step: int) -> None:
        stats = self.manager.stats
        stall, device = stats.stall_s, stats.device_stall_s
        self.manager.save(step, self.job.state(), force=True)
        self._pending = (stall, device)

    def settle(self) -> None:
        """After the step that followed the save, the device synchronised: its copy and waits."""
        stall, device = self._pending
        stats = self.manager.stats
        self.marks["copy_ms"].append(round(self.copies.take_ms(), 3))
        self.marks["compute_wait_ms"].append(round(1e3 * (stats.device_stall_s - device), 3))
        self.marks["host_stall_ms"].append(round(1e3 * (stats.stall_s - stall - (stats.device_stall_s - device)), 3))

    def drain(self) -> None:
        self.manager.wait()

    def close(self) -> None:
        self.notes["host_buffer_gib"] = round(self.manager.stats.host_buffer_bytes / GIB, 2)
        self.manager.close()


class DCPSaver:
    """Shared by the DCP savers: the futures of the last save and the waits on them."""

    warm_saves = 1
    staging = upload = None

    def __init__(self, ctx: Context, job: Job, root: Path):
        self.ctx, self.job, self.root, self.marks, self.notes = ctx, job, root, Marks(), {}

    def wait_upload(self) -> None:
        start = time.perf_counter()
        if self.upload is not None:
            self.upload.result()
        self.marks.since("upload_wait_ms", start)

    def track(self, staging, upload, start: float) -> None:
        self.staging, self.upload = staging, upload
        if staging is not None:
            self.marks.when_done("staging_s", staging, start)
        self.marks.when_done("upload_s", upload, start)

    def before_optimizer(self) -> None:
        if self.staging is not None:  # a wait is counted only where a staging was pending
            start = time.perf_counter()
            self.staging.result()
            self.staging = None
            self.marks.since("staging_wait_ms", start)

    def settle(self) -> None:
        pass

    def drain(self) -> None:
        if self.staging is not None:
            self.staging.result()
        if self.upload is not None:
            self.upload.result()

    def close(self) -> None:
        self.drain()


class KeptStager(DefaultStager):
    """DCP's ``DefaultStager``, keeping the future of the state dict it staged last (to read its bytes)."""

    last = None

    def stage(self, state_dict, **kwargs):
        self.last = super().stage(state_dict, **kwargs)
        return self.last


class TitanCalls(DCPSaver):
    label = "torchtitan async_with_pinned_mem, its DCP calls (DefaultStager(True, True, True, True), PROCESS)"

    def __init__(self, ctx: Context, job: Job, root: Path):
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import StagingOptions

        super().__init__(ctx, job, root)
        self.pg = dist.new_group(backend="gloo")  # torchtitan's own group for async saves
        self.options = StagingOptions(use_pinned_memory=True, use_shared_memory=True, use_async_staging=True,
                                      use_non_blocking_copy=ctx.accel is not None)
        self.notes["staging_options"] = str(self.options)
        self.stager = None

    def save(self, step: int, at_save=None) -> None:
        """One save as torchtitan makes it; ``at_save(states)`` is called right before ``async_save``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.wait_upload()  # maybe_wait_for_saving
        start = time.perf_counter()
        gc.collect(1)  # GarbageCollection.collect
        self.marks.since("gc_ms", start)
        model = self.job.model
        states = {**model.state_dict(), "optimizer": get_optimizer_state_dict(
            model, self.job.opt, options=StateDictOptions(flatten_optimizer_state_dict=True))}
        if self.stager is None:
            self.stager = KeptStager(self.options)
        if at_save is not None:
            at_save(states)
        called = time.perf_counter()
        response = dcp.async_save(states, checkpoint_id=str(self.root / f"step-{step}"), process_group=self.pg,
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        self.track(response.staging_completion, response.upload_completion, called)
        self.marks.since("call_ms", start)

    def close(self) -> None:
        super().close()
        if self.stager is not None:
            self.stager.close()


class DataPosition:
    """A data loader's place for torchtitan's manager (a Stateful it saves)."""

    def state_dict(self) -> dict:
        return {"position": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


class TitanManager(DCPSaver):
    label = "torchtitan's CheckpointManager"

    def __init__(self, ctx: Context, job: Job, root: Path):
        from torchtitan.components.checkpointer import CheckpointManager
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig

        super().__init__(ctx, job, root)
        job.opt = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4, "betas": (0.9, 0.95),
                                                                    "weight_decay": 0.1})],
            implementation="foreach").build(model_parts=[job.model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=job.opt, training_steps=1 << 20)
        mode = "async_with_pinned_mem" if ctx.accel is not None else "async"  # pinned needs an accelerator
        self.label = f"torchtitan's CheckpointManager ({mode}), its OptimizersContainer (AdamW, foreach)"
        self.manager = CheckpointManager.Config(enable=True, folder=root.name, interval=1, async_mode=mode,
                                                keep_latest_k=2).build(
            dataloader=DataPosition(), model_parts=[job.model], optimizers=job.opt, lr_schedulers=schedulers,
            states={}, sd_adapter=None, base_folder=str(root.parent))

    def save(self, step: int) -> None:
        start = time.perf_counter()
        self.manager.maybe_wait_for_saving()
        self.marks.since("upload_wait_ms", start)
        start = time.perf_counter()
        self.manager.save(step)
        self.marks.since("call_ms", start)
        self.track(self.manager.staging_future, self.manager.save_future, start)

    def before_optimizer(self) -> None:
        pending = self.manager.staging_future is not None
        start = time.perf_counter()
        self.manager.maybe_wait_for_staging()
        if pending:
            self.marks.since("staging_wait_ms", start)

    def drain(self) -> None:
        self.manager.maybe_wait_for_staging()
        self.manager.maybe_wait_for_saving()

    def close(self) -> None:
        self.drain()
        self.manager.close()


class DCPDefault(DCPSaver):
    label = "dcp.async_save, DCP's default staging (a copy inside the call), upload thread"

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait_upload()
        start = time.perf_counter()
        model_sd, optim_sd = get_state_dict(self.job.model, self.job.opt)
        upload = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(self.root / f"step-{step}"))
        self.track(None, upload, start)
        self.marks.since("call_ms", start)


def titan_cannot_run(ctx: Context) -> str | None:
    """Why torchtitan's pinned path cannot run here, if it cannot: its staged copies live in /dev/shm
    (the checkpoint process reads them from there), and a full /dev/shm kills the process (SIGBUS)."""
    if ctx.shared_staging:
        return None
    return "skipped: /dev/shm cannot hold the staged copies DCP's checkpoint process reads"


def titan_saver(ctx: Context, job: Job, root: Path):
    """torchtitan's own manager where its package imports, else its DCP calls (noted)."""
    try:
        return TitanManager(ctx, job, root)
    except ImportError as exc:
        saver = TitanCalls(ctx, job, root)
        saver.notes["instead_of_its_manager"] = f"torchtitan does not import ({exc}): its DCP calls"
        return saver

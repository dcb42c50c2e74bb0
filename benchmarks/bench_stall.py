#!/usr/bin/env python
"""Checkpoint stall in a training loop: ours against its peers, in one run (issue 3).

    python benchmarks/bench_stall.py --quick                                  # smoke run, < 30 s
    python benchmarks/bench_stall.py --tiny                                   # every method on a 5 MiB state (the tests)
    python benchmarks/bench_stall.py --gib 1 --saves 3 --nosave-steps 10    # ~3 min on a quiet 2-core box

A single-process CPU training loop: a stack of ``Linear(hidden, hidden)`` layers sized so that weights +
AdamW state (``exp_avg``, ``exp_avg_sq``: 3 x 4 bytes per fp32 parameter) come to about ``--gib`` GiB,
trained on random batches of ``--batch`` rows (MSE loss; one real forward/backward/AdamW step).

The **stall** of a save is the time the training thread is blocked by checkpointing: the time inside the
save call plus any wait before the next optimizer step (the first moment the parameters change). Every
method runs as one phase of ``--saves x --every`` training steps with a save after steps 1, 1+K,
1+2K, ... (K = ``--every``), preceded by one untimed warm-up save (buffers, first-call costs) that is
drained before the phase starts. Each phase reports the median stall over its saves. Phases run one
after another in the same process on the same (continuing) model, with a no-save phase (``--nosave-steps``
steps; default as many as a method's phase) before and after every method: the mean rate of those two is
that method's throughput baseline (the machine drifts).

What is timed (``time.perf_counter`` on the training thread):

no save          nothing: the baseline step time and steps/s.
bare copy_       ``dst.copy_(src)`` of every state tensor (weights, exp_avg, exp_avg_sq, step) into
                 buffers preallocated (and faulted in) at set-up: the limit when the copy is not
                 overlapped with compute. Stall = the copy.
ckpt manager     ``ckpt.CheckpointManager(dir, interval=1, async_mode="double_buffer")`` with
                 ``manager.attach(optimizer)``; ``manager.save(step, {"model": model, "optim": opt})``.
                 Stall = our timing around ``save()`` + the time the optimizer step pre-hook waited
                 for the snapshot (the increase of ``manager.stats.stall_s`` across the next
                 ``optimizer.step()``; ``stats.stall_s`` only grows when the hook really waited).
ckpt manager sync   the same with ``async_mode="sync"``: the whole save (write, fsync, commit) inline.
DCP async_save   ``dcp.async_save(get_state_dict(model, opt), storage_writer=FileSystemWriter(dir),
 (default)       no_dist=True)``, ``async_stager=None``. FileSystemWriter is itself a
                 ``BlockingAsyncStager`` (no cache), so DCP stages with it: a fresh CPU copy made
                 synchronously inside ``async_save``, which then returns a plain ``Future`` (the
                 upload). Stall = wait for the previous upload (DCP's contract: one async_save in
                 flight) + ``get_state_dict`` + ``async_save``.
DCP async_save   the same with ``async_stager=DefaultStager(StagingOptions(use_pinned_memory=False,
 (caching)       use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False))`` (the
                 CPU-capable options: pinned memory is ignored and non-blocking copy is refused without
                 an accelerator). It caches staging storages per source storage and copies on a
                 background thread; ``async_save`` returns an ``AsyncSaveResponse``. Stall = wait for
                 the previous ``upload_completion`` + ``get_state_dict`` + ``async_save`` + the wait for
                 ``staging_completion`` right before the next ``optimizer.step()``.
torch.save       ``torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, file)`` + fsync
                 of the file, synchronously. Stall = all of it.
torchsnapshot    ``torchsnapshot.Snapshot.async_take(dir, app_state={"model": model, "optim": opt})``.
                 It stages synchronously inside the call (``sync_execute_write_reqs`` returns once every
                 write request is past staging: a CPU copy of every tensor, since the source may change)
                 and writes on the ``PendingSnapshot``'s thread. One snapshot in flight, as for DCP: Stall
                 = ``wait()`` for the previous one + ``async_take``. Its file-system plugin does not
                 fsync, so its "durable" time is only "written" (page cache).

The goals (issue 15): ours' median stall <= 0.05x the bare copy's, and below every peer's.

Steps/s and process CPU time (every thread) per step are measured over the whole phase (saves
included); the upload of the last save may still run at the phase's end, and the time to drain it is
reported separately. Host memory (RSS read after ``gc.collect()`` and glibc ``malloc_trim(0)``):
``VmRSS`` after the drained warm-up save minus before the method's set-up (what the method keeps
resident), and the peak ``VmHWM`` during the phase (reset through ``/proc/self/clear_refs`` at its
start) minus the RSS after the warm-up, minus the same growth of the adjacent no-save phases (gradients,
activations). For the manager, ``stats.host_buffer_bytes`` is compared with the state. The notes break
our ``save()`` down by wrapping public engine functions from here (the engine itself is not modified),
and take the time until a save is durable from the manager's ``on_commit`` (``CommitInfo``): the
benchmark uses public names only, so a refactor of the engine's insides cannot break it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from harness import Load, argument_parser, machine_description, median, settle, work_dir  # first: sys.path

import ckpt  # noqa: E402
import ckpt.manager  # noqa: E402
import peers  # noqa: E402
from probes import peak_rss, reset_peak, rss  # noqa: E402
from report import (  # noqa: E402
    command_line, goal, goal_line, median_span, metric, provenance, publish, table_head, write_json,
)
from states import model_and_optimizer_tensors  # noqa: E402

torchsnapshot = peers.torchsnapshot_module()  # an optional peer (the "bench" extra), skipped with a note when missing

BENCH_NAME = "stall"
SECTION = "## Checkpoint stall in a training loop (issue 3)"
GOAL_COPY_RATIO = 0.05  # issue 15: ours' stall <= 0.05x the bare copy
HIDDEN = 2048
QUICK = {"gib": 0.05, "saves": 2, "every": 3, "nosave_steps": 3}  # --quick: a smoke run, < 30 s on 2 idle cores
TINY = {"gib": 0.005, "hidden": 256, "saves": 1, "every": 2, "nosave_steps": 2}  # --tiny: the tests' run of every part

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message=".*torch.distributed.*not initialized.*")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")


# ---------------------------------------------------------------------------------------------
# The training job
# ---------------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, gib: float, batch: int, hidden: int = HIDDEN, seed: int = 0):
        torch.manual_seed(seed)
        per_layer = hidden * hidden + hidden
        layers = max(1, round(gib * (1 << 30) / 12 / per_layer))
        self.model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(batch, hidden)
        self.y = torch.randn(batch, hidden)
        self.layers, self.hidden, self.batch = layers, hidden, batch
        self.params = sum(p.numel() for p in self.model.parameters())

    def forward_backward(self) -> None:
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_tensors(self) -> list[torch.Tensor]:
        return model_and_optimizer_tensors(self.model, self.opt)

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.state_tensors())

    def describe(self) -> str:
        return (f"{self.layers} x Linear({self.hidden}, {self.hidden}) = {self.params / 1e6:.1f} M fp32 params; "
                f"weights + AdamW state {self.state_bytes() / 2**30:.3f} GiB; batch {self.batch} x {self.hidden}, "
                f"MSE loss, AdamW (default implementation)")


# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------
@dataclass
class SaveRecord:
    in_save: float = 0.0  # inside the save call on the training thread (incl. waits inside it)
    pre_step_wait: float = 0.0  # waited before the next optimizer step
    parts: dict[str, float] = field(default_factory=dict)  # breakdown, where known
    start: float = 0.0
    durable: float | None = None  # seconds from the save's start until its bytes were committed

    @property
    def stall(self) -> float:
        return self.in_save + self.pre_step_wait


class Method:
    name = ""  # the table's row
    key = ""  # --methods
    label = ""  # the short system label of the JSON metrics (plot legends)
    note = ""
    saves = True
    fsyncs = True  # whether "durable" means fsync'd (else only written)

    def __init__(self, trainer: Trainer, work: Path):
        self.trainer, self.work = trainer, work
        self.records: list[SaveRecord] = []
        self.extra: dict[str, Any] = {}

    def setup(self) -> None:
        pass

    def save(self, step: int, rec: SaveRecord) -> None:
        raise NotImplementedError

    def before_step(self, rec: SaveRecord | None) -> None:
        """Called right before ``optimizer.step()``; time spent here counts as the last save's wait."""

    def after_step(self, rec: SaveRecord | None) -> None:
        """Called right after ``optimizer.step()`` (to read waits that happened inside it)."""

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def host_buffer_bytes(self) -> int | None:
        return None


class NoSave(Method):
    name, key, note, saves = "no save (baseline)", "none", "", False


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
        t0 = time.perf_counter()
        self.dcp.wait_previous()
        t1 = time.perf_counter()
        model_sd, optim_sd = get_state_dict(self.trainer.model, self.trainer.opt)
        sd = {"model": model_sd, "optim": optim_sd}
        t2 = time.perf_counter()
        upload = self.dcp.save(sd, self.work / self.key / f"step-{step:08d}")
        t3 = time.perf_counter()
        upload.add_done_callback(lambda _f, rec=rec: setattr(rec, "durable", time.perf_counter() - rec.start))
        rec.parts = {"wait previous upload": t1 - t0, "get_state_dict": t2 - t1, "async_save()": t3 - t2}

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
        self.watchers: list[threading.Thread] = []

    def save(self, step: int, rec: SaveRecord) -> None:
        t0 = time.perf_counter()
        self.snapshot.wait_previous()  # one snapshot in flight, as for DCP; the wait blocks training: stall
        t1 = time.perf_counter()
        app_state = {"model": self.trainer.model, "optim": self.trainer.opt}
        pending = self.snapshot.take(self.work / self.key / f"step-{step:08d}", app_state)
        t2 = time.perf_counter()
        rec.parts = {"wait previous snapshot": t1 - t0, "async_take()": t2 - t1}
        # PendingSnapshot has no callback: a watcher (it only blocks in join) records when it was written
        watcher = threading.Thread(target=self._watch, args=(pending.thread, rec), daemon=True)
        watcher.start()
        self.watchers.append(watcher)

    @staticmethod
    def _watch(thread: threading.Thread, rec: SaveRecord) -> None:
        thread.join()
        rec.durable = time.perf_counter() - rec.start

    def drain(self) -> None:
        self.snapshot.drain()
        for w in self.watchers:
            w.join()

    def close(self) -> None:
        self.drain()


METHODS = {m.key: m for m in (BareCopy, Ours, OursSync, DCPAsync, DCPCaching, TorchSave, TorchSnapshot)}


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    key: str
    note: str
    steps: int = 0
    window_s: float = 0.0
    cpu_s: float = 0.0
    drain_s: float = 0.0
    fb: list[float] = field(default_factory=list)  # forward/backward times, every step
    opt: list[float] = field(default_factory=list)  # optimizer.step times, every step (incl. hook)
    fb_after_save: list[float] = field(default_factory=list)  # forward/backward of the step after a save
    fb_other: list[float] = field(default_factory=list)  # forward/backward of the other steps
    records: list[SaveRecord] = field(default_factory=list)
    warmup: SaveRecord | None = None
    rss_before: int = 0
    rss_after_warmup: int = 0
    peak_window: int | None = None
    rss_end: int = 0
    host_buffer_bytes: int | None = None
    extra: dict = field(default_factory=dict)
    copies: list[tuple[float, float]] = field(default_factory=list)


def train_step(trainer: Trainer, method: Method, pending: SaveRecord | None, phase: Phase | None) -> None:
    t0 = time.perf_counter()
    trainer.forward_backward()
    t1 = time.perf_counter()
    method.before_step(pending)
    t2 = time.perf_counter()
    trainer.optimizer_step()
    t3 = time.perf_counter()
    if pending is not None:
        pending.pre_step_wait += t2 - t1
    method.after_step(pending)
    if phase is not None:
        phase.fb.append(t1 - t0)
        phase.opt.append(t3 - t2)
        if pending is not None:
            phase.fb_after_save.append(t1 - t0)
        else:
            phase.fb_other.append(t1 - t0)


def do_save(method: Method, step: int) -> SaveRecord:
    rec = SaveRecord(start=time.perf_counter())
    method.save(step, rec)
    rec.in_save = time.perf_counter() - rec.start
    return rec


def run_phase(cls: type[Method], trainer: Trainer, work: Path, steps: int, every: int, label: str = "") -> Phase:
    """One phase of ``steps`` training steps, with a save after steps 1, 1 + every, ... if the method saves."""
    method = cls(trainer, work)
    phase = Phase(cls.name + label, cls.key, cls.note)
    settle()
    phase.rss_before = rss()
    method.setup()
    try:
        if method.saves:  # untimed warm-up save: buffers, first-call costs; drained before the window
            train_step(trainer, method, None, None)
            rec = do_save(method, 0)
            train_step(trainer, method, rec, None)
            method.drain()
            phase.warmup = rec
        settle()
        phase.rss_after_warmup = rss()
        phase.peak_window = phase.rss_after_warmup if reset_peak() else None
        start, cpu_start = time.perf_counter(), time.process_time()
        pending: SaveRecord | None = None
        for j in range(1, steps + 1):
            train_step(trainer, method, pending, phase)
            pending = None
            if method.saves and (j - 1) % every == 0:
                pending = do_save(method, j)
                phase.records.append(pending)
        phase.window_s = time.perf_counter() - start
        phase.cpu_s = time.process_time() - cpu_start  # every thread of the process
        phase.steps = steps
        if phase.peak_window is not None:
            phase.peak_window = peak_rss()
        t = time.perf_counter()
        method.drain()
        phase.drain_s = time.perf_counter() - t
        phase.host_buffer_bytes = method.host_buffer_bytes()
        phase.copies = list(getattr(method, "copies", []))
    finally:
        method.close()
    phase.extra = method.extra
    settle()
    phase.rss_end = rss()
    shutil.rmtree(work / cls.key, ignore_errors=True)
    return phase


def print_phase(p: Phase) -> None:
    line = (f"{p.name:42s} step {median([a + b for a, b in zip(p.fb, p.opt)]):.3f}s "
            f"({p.steps / p.window_s:.2f} steps/s)")
    if p.records:
        stalls = [r.stall for r in p.records]
        line += (f" | stall median {median(stalls):.3f}s [" + " ".join(f"{s:.3f}" for s in stalls) + "]"
                 f" in save {median([r.in_save for r in p.records]):.3f}s, pre-step wait "
                 f"{median([r.pre_step_wait for r in p.records]):.3f}s | drain {p.drain_s:.2f}s")
    print(line, flush=True)
    for i, r in enumerate(p.records):
        if r.parts:
            print("    save %d: " % i + ", ".join(f"{k} {v:.4f}" for k, v in r.parts.items())
                  + (f", durable after {r.durable:.2f}s" if r.durable is not None else ""), flush=True)


def run(args: argparse.Namespace) -> tuple[list[Phase], dict]:
    with work_dir(args.dir, "stall-", keep=args.keep) as work:
        info: dict = {"work": work}
        t0 = time.perf_counter()
        trainer = Trainer(args.gib, args.batch, args.hidden)
        for _ in range(3):  # untimed: AdamW creates its state at the first step; fault everything in
            trainer.forward_backward()
            trainer.optimizer_step()
        info["nbytes"] = trainer.state_bytes()
        info["state"] = trainer.describe()
        info["machine"] = machine_description(work, [f"torch threads {torch.get_num_threads()}"])
        print(f"state: {info['state']} (built in {time.perf_counter() - t0:.1f}s)", flush=True)
        print(f"work dir: {work}", flush=True)

        keys = args.methods or [k for k in METHODS if k != "torchsnapshot" or torchsnapshot is not None]
        if torchsnapshot is None:
            info["skipped"] = "torchsnapshot is not installed (`pip install torchsnapshot`): its row is missing"
            print(info["skipped"], flush=True)
            keys = [k for k in keys if k != "torchsnapshot"]
        order = [NoSave]
        for k in keys:  # a no-save phase before and after every method: its own throughput baseline
            order += [METHODS[k], NoSave]
        load = Load()
        phases = []
        for i, cls in enumerate(order):
            label = "" if cls is not NoSave else f" #{i // 2 + 1}"
            steps = args.saves * args.every if cls.saves else args.nosave_steps
            phase = run_phase(cls, trainer, work, steps, args.every, label)
            print_phase(phase)
            phases.append(phase)
        info["contention"] = load.stop().describe("during the run")
        return phases, info


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def gib(n: float) -> str:
    return f"{n / 2**30:+.2f}"


NOT_PEERS = ("ours", "ours-sync", "copy")  # ours in either mode, and the limit


def stalls(p: Phase) -> list[float]:
    return [r.stall for r in p.records]


def phase_of(phases: list[Phase], key: str) -> Phase | None:
    return next((p for p in phases if p.key == key and p.records), None)


def neighbours_in(phases: list[Phase], p: Phase) -> list[Phase]:
    """The no-save phases right before and after ``p``."""
    i = phases.index(p)
    return [q for q in phases[max(i - 1, 0) : i + 2] if q.key == "none" and q is not p]


def base_rate_in(phases: list[Phase], p: Phase) -> float:
    """steps/s of the no-save phases right before and after ``p`` (the machine drifts)."""
    near = neighbours_in(phases, p)
    return sum(q.steps for q in near) / sum(q.window_s for q in near)


def durable_times(p: Phase) -> list[float]:
    """Seconds from each save's call until its bytes were committed; a synchronous save is committed
    when its call returns."""
    if p.key in ("ours-sync", "torch-save"):
        return [r.in_save for r in p.records]
    return [r.durable for r in p.records if r.durable is not None]


def goals_of(phases: list[Phase], nbytes: int) -> list[dict]:
    """Issue 15's goals for ours (double_buffer), as measured: median stall against the bare copy's,
    against the best peer's, and the host buffers against the state."""
    ours, copy = phase_of(phases, "ours"), phase_of(phases, "copy")
    name = f"stall ≤ {GOAL_COPY_RATIO}× bare copy"
    if ours is None:
        return [goal(name, None, GOAL_COPY_RATIO, "<=", "ours did not run")]
    s = median(stalls(ours))
    out = []
    if copy is not None:
        c = median(stalls(copy))
        per_save = [x / c for x in stalls(ours)]
        out.append(goal(name, s / c, GOAL_COPY_RATIO, "<=",
                        f"median over {len(per_save)} saves: ours {s:.4f} s vs bare copy {c:.4f} s "
                        f"(median of {len(copy.records)}); per save {min(per_save):.3f}–{max(per_save):.3f}×"))
    else:
        out.append(goal(name, None, GOAL_COPY_RATIO, "<=", "the bare copy did not run"))
    peers = [p for p in phases if p.records and p.key not in NOT_PEERS]
    if peers:
        best = min(peers, key=lambda p: median(stalls(p)))
        b = median(stalls(best))
        not_below = [p.name for p in peers if median(stalls(p)) <= s]
        out.append(goal("stall below every peer", s / b, 1.0, "<=",
                        f"ours / best peer's median stall: ours {median_span(stalls(ours), 4)} s vs "
                        f"{METHODS[best.key].label} {median_span(stalls(best), 4)} s"
                        + (f"; not below: {', '.join(not_below)}" if not_below else "")))
    if ours.host_buffer_bytes:
        out.append(goal("host buffers ≤ 2× state", round(ours.host_buffer_bytes / nbytes, 3), 2.0, "<=",
                        f"stats.host_buffer_bytes {ours.host_buffer_bytes / 2**30:.3f} GiB, state "
                        f"{nbytes / 2**30:.3f} GiB"))
    return out


def metrics_of(phases: list[Phase]) -> list[dict]:
    """Per system: stall per save (s and × the bare copy's median), steps/s against the adjacent
    no-save phases, and the time until each save was durable (``written_s`` where not fsync'd)."""
    copy = phase_of(phases, "copy")
    copy_stall = median(stalls(copy)) if copy is not None else None
    out = []
    for p in phases:
        if not p.records:
            continue
        method = METHODS[p.key]
        out.append(metric(method.label, "stall_s", "s", stalls(p)))
        if copy_stall:
            out.append(metric(method.label, "stall_x_copy", "×", [x / copy_stall for x in stalls(p)]))
        out.append(metric(method.label, "steps_per_s_x_nosave", "×",
                          [p.steps / p.window_s / base_rate_in(phases, p)]))
        durable = durable_times(p)
        if durable:
            out.append(metric(method.label, "durable_s" if method.fsyncs else "written_s", "s", durable))
    return out


def report(phases: list[Phase], info: dict, args: argparse.Namespace, command: str, goals: list[dict]) -> str:
    nbytes = info["nbytes"]
    base = [p for p in phases if p.key == "none"]
    base_rates = [p.steps / p.window_s for p in base]
    base_fb = median([x for p in base for x in p.fb])
    base_opt = median([x for p in base for x in p.opt])
    copy = phase_of(phases, "copy")
    copy_stall = median(stalls(copy)) if copy else None

    def neighbours(p: Phase) -> list[Phase]:
        return neighbours_in(phases, p)

    def base_rate_of(p: Phase) -> float:
        return base_rate_in(phases, p)

    def base_fb_of(p: Phase) -> float:
        return median([x for q in neighbours(p) for x in q.fb])

    def cpu_cell(p: Phase) -> str:
        near = neighbours(p)
        per_step = p.cpu_s / p.steps
        ref = sum(q.cpu_s for q in near) / sum(q.steps for q in near)
        return f"{per_step:.2f} ({per_step / ref:.2f})"

    def peak_cell(p: Phase) -> str:
        """Peak RSS growth in the phase beyond that of the adjacent no-save phases (gradients, activations)."""
        if p.peak_window is None:
            return "n/a"
        base_growth = median([q.peak_window - q.rss_after_warmup for q in neighbours(p)])
        return gib(p.peak_window - p.rss_after_warmup - base_growth) + " GiB"

    lines = [
        *table_head(["Method", "Stall s, median (min–max)", "× bare copy", "in save()", "wait before next opt.step",
                     "Steps/s (× no save)", "CPU s per step (× no save)", "Next fwd/bwd − other steps s",
                     "Durable after s", "Resident after warm-up", "Peak growth beyond no save", "Notes"],
                    "l" + "r" * 10 + "l"),
        f"| no save (baseline; {len(base)} phases) | – | – | – | – | {median_span(base_rates)} "
        f"| {median([q.cpu_s / q.steps for q in base]):.2f} | – | – "
        f"| – | {gib(median([p.peak_window - p.rss_after_warmup for p in base])) + ' GiB (grads etc.)' if base[0].peak_window is not None else 'n/a'} "
        f"| median step {base_fb + base_opt:.3f} s (fwd/bwd {base_fb:.3f} + AdamW {base_opt:.3f}) |",
    ]
    for p in phases:
        if p.key == "none":
            continue
        rate = p.steps / p.window_s
        mem_resident = gib(p.rss_after_warmup - p.rss_before) + " GiB"
        mem_peak = peak_cell(p)
        per_save = stalls(p)
        s = median(per_save)
        durable = [r.durable for r in p.records if r.durable is not None]
        ratio = f"{s / copy_stall:.2f}" if copy_stall else "–"
        next_fb = median(p.fb_after_save) - median(p.fb_other)
        note = p.note
        if p.host_buffer_bytes is not None:
            note += f"; host_buffer_bytes {p.host_buffer_bytes / nbytes:.2f}× state"
        durable_cell = f"{median(durable):.2f} (drain {p.drain_s:.2f})" if durable else ("–" if p.key == "copy" else "in save")
        if durable and not METHODS[p.key].fsyncs:
            durable_cell += " written, no fsync"
        lines.append(
            f"| {p.name} | {median_span(per_save)} | {ratio} "
            f"| {median([r.in_save for r in p.records]):.3f} | {median([r.pre_step_wait for r in p.records]):.3f} "
            f"| {rate:.3f} ({rate / base_rate_of(p):.2f}) | {cpu_cell(p)} | {next_fb:+.3f} "
            f"| {durable_cell} | {mem_resident} | {mem_peak} | {note} |"
        )

    notes = []
    if info.get("skipped"):
        notes.append(f"- Not run: {info['skipped']}.")
    ours = phase_of(phases, "ours")
    if goals:
        notes.append("- Goals of issue 15, for ckpt CheckpointManager (double_buffer), on medians:")
        notes += ["  " + goal_line(g) for g in goals]
    if ours is not None:
        s = median(stalls(ours))
        rate = ours.steps / ours.window_s
        step = median([a + b for q in neighbours(ours) for a, b in zip(q.fb, q.opt)])
        notes.append(f"- Ours, throughput with a save every {args.every} steps: {rate / base_rate_of(ours):.2f}× the "
                     f"adjacent no-save phases ({rate:.3f} vs {base_rate_of(ours):.3f} steps/s; the stall alone costs "
                     f"{100 * s / (args.every * step):.2f} % of {args.every} steps of {step:.3f} s).")
        # Where the training thread spent save(), and the background copy vs the overlapped step
        parts: dict[str, list[float]] = {}
        for r in ours.records:
            for k, v in r.parts.items():
                if k != "manager stats.last_stall_s":
                    parts.setdefault(k, []).append(v)
        if parts:
            top = ("export_state", "tensor_signature", "stage()")
            notes.append("- Ours, training thread inside save() (medians): "
                         + ", ".join(f"{k} {median(v) * 1e3:.1f} ms" for k, v in parts.items())
                         + f"; rest of save() {median([r.in_save - sum(r.parts.get(k, 0.0) for k in top) for r in ours.records]) * 1e3:.1f} ms"
                         " (stage(): `DoubleBufferStager.stage`, its capture of plain values, its wait for a free buffer set and the copy's submission). "
                         f"Manager's own stats.last_stall_s (median) {median([r.parts.get('manager stats.last_stall_s', float('nan')) for r in ours.records]):.3f} s.")
        if ours.copies:
            durations = [b - a for a, b in ours.copies]
            notes.append(f"- Ours, background snapshot (from the `stage()` call until its Future was done): median "
                         f"{median(durations):.3f} s ({nbytes / median(durations) / 1e9:.2f} GB/s) while the next "
                         f"forward/backward took {median(ours.fb_after_save):.3f} s (the phase's other steps: {median(ours.fb_other):.3f} s; "
                         f"adjacent no-save phases: {base_fb_of(ours):.3f} s).")
        if ours.extra.get("write_s"):
            writes = ours.extra["write_s"]
            notes.append(f"- Ours, background write of a step, from its start to its commit (`CommitInfo.seconds`, "
                         f"told to `on_commit`): median {median(writes):.3f} s over {len(writes)} commits (warm-up included).")
    notes.append(f"- Drift: the {len(base)} no-save phases ran at {min(base_rates):.3f}–{max(base_rates):.3f} steps/s "
                 f"(×{max(base_rates) / min(base_rates):.2f} spread) because of the machine's other load; a throughput "
                 f"ratio inside that spread says nothing about the method.")
    for p in phases:
        if (p.key.startswith("dcp") or p.key == "torchsnapshot") and p.records:
            parts = {}
            for r in p.records:
                for k, v in r.parts.items():
                    parts.setdefault(k, []).append(v)
            wait = "wait previous upload" if p.key.startswith("dcp") else "wait previous snapshot"
            no_wait = median([r.stall - r.parts.get(wait, 0.0) for r in p.records])
            returned = p.extra.get("async_save returned")
            notes.append(f"- {p.name}, inside the save (medians): "
                         + ", ".join(f"{k} {median(v):.3f} s" for k, v in parts.items())
                         + f"; stall without the {wait.replace('wait previous', 'wait for the previous')} {no_wait:.3f} s"
                         + (f"; async_save returned {', '.join(returned)}" if returned else "") + ".")
    body = [
        SECTION,
        "",
        f"Job: {info['state']}. One phase per method, {args.saves} saves per phase, one save every {args.every} "
        f"steps ({args.saves * args.every} steps per phase) after one untimed, drained warm-up save; phases run "
        f"one after another on the same model in the same process, with a no-save phase of {args.nosave_steps} steps "
        f"before and after every method "
        f"(its throughput baseline is the mean rate of those two; median step {base_fb + base_opt:.3f} s = "
        f"forward/backward {base_fb:.3f} s + AdamW step {base_opt:.3f} s). **Stall** = time on the training thread inside the save call + time "
        f"waited before the next `optimizer.step()`; the table gives the median over the saves of a phase.",
        "",
        *lines,
        "",
        "Notes:",
        *notes,
        "- Columns: *in save()* and *wait before next opt.step* are the two parts of the stall. For ours the wait is "
        "what the `attach()` pre-hook waited (the increase of `manager.stats.stall_s` across the next "
        "`optimizer.step()`); for DCP with the caching stager it is `response.staging_completion.result()` called right "
        "before `optimizer.step()`; DCP's wait for the previous upload is inside *in save()*. *Steps/s* is over the "
        "whole phase, saves included; (× no save) divides it by the rate of the no-save phases right before and after. *CPU s per step*: CPU time of the whole process (every thread: training, "
        "staging, writing) per step over the phase, against the adjacent no-save phases: the work a method adds, less "
        "sensitive to the machine's other load than wall time. *Next fwd/bwd − other steps*: how much longer the "
        "forward/backward right after a save took than the median of the phase's other forward/backwards (the cost of a "
        "background copy competing for the cores; not counted as stall). *Durable after*: seconds from the save call until its bytes were "
        "committed (drain: waiting at the phase end for the last one). *Resident after warm-up*: RSS after the drained "
        "warm-up save minus before the method's set-up; *Peak growth beyond no save*: peak RSS (VmHWM, reset at the phase "
        "start) minus the RSS after the warm-up, minus the same growth of the adjacent no-save phases (gradients and "
        "activations, shown in the baseline row). RSS figures move with what the allocator keeps or returns, "
        "to about ±0.1–0.4 GiB.",
        "- DCP's state dict is `get_state_dict(model, optimizer)` (torch.distributed.checkpoint.state_dict), made at every "
        "save and counted in its stall, as ours counts its `export_state`. With `async_stager=None` DCP stages with the "
        "`FileSystemWriter` itself (a `BlockingAsyncStager`, no cache: a fresh copy per save, inside `async_save`). "
        "The caching `DefaultStager` runs on CPU only with `use_pinned_memory=False` (ignored without CUDA) and "
        "`use_non_blocking_copy=False` (refused without an accelerator).",
        "- torchsnapshot: `Snapshot.async_take(dir, app_state={\"model\": model, \"optim\": optimizer})` takes the "
        "state dicts and stages every tensor (a CPU copy, since the live tensor may change) inside the call, on a thread "
        "pool it shuts down before returning; only the file writes run on the `PendingSnapshot`'s thread. One snapshot "
        "in flight: the next save first `wait()`s for the previous one (in its stall). Its file-system plugin does not "
        "fsync: *Durable after* is only the time until its files and metadata were written.",
        "",
        *provenance(info["machine"], command, load=info["contention"]),
    ]
    return "\n".join(body)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    parser.add_argument("--gib", type=float, default=1.0, help="weights + AdamW state in GiB (default 1.0)")
    parser.add_argument("--saves", type=int, default=4, help="timed saves per method (default 4)")
    parser.add_argument("--every", type=int, default=5, help="save every K steps (default 5; >= 2)")
    parser.add_argument("--batch", type=int, default=32, help="rows per batch (default 32)")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"layer width (default {HIDDEN})")
    parser.add_argument("--nosave-steps", type=int,
                        help="steps of each no-save phase (default: --saves x --every, as a method's phase)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS),
                        help="subset to run (the no-save baseline always runs)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (< 30 s on 2 idle cores): " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                                           for k, v in QUICK.items()))
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' smoke run (every method, a 5 MiB state): " + ", ".join(
                            f"--{k.replace('_', '-')} {v}" for k, v in TINY.items()))
    args = parser.parse_args(argv)
    for k, v in (TINY if args.tiny else QUICK if args.quick else {}).items():
        setattr(args, k, v)
    if args.nosave_steps is None:
        args.nosave_steps = args.saves * args.every
    if args.saves < 1 or args.every < 2 or args.gib <= 0 or args.batch < 1 or args.nosave_steps < 1:
        parser.error("--saves must be >= 1, --every >= 2, --gib > 0, --batch >= 1, --nosave-steps >= 1")

    command = command_line("bench_stall.py", argv)
    phases, info = run(args)
    goals = goals_of(phases, info["nbytes"])
    section = report(phases, info, args, command, goals)
    publish(section, args.out)
    params = {"gib": args.gib, "state_bytes": info["nbytes"], "saves": args.saves, "every": args.every,
              "nosave_steps": args.nosave_steps, "batch": args.batch, "hidden": args.hidden, "quick": args.quick,
              "tiny": args.tiny, "state": info["state"], "torch_threads": torch.get_num_threads()}
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics_of(phases), goals=goals, params=params)
    return 0


if __name__ == "__main__":
    sys.exit(main())

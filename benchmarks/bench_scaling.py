#!/usr/bin/env python
"""Checkpoint stall as the state grows and as ranks are added: ours against its peers, one curve each.

    python benchmarks/bench_scaling.py --quick                          # ~25 s on a quiet 2-core box
    python benchmarks/bench_scaling.py --tiny                           # the tests' run: 4 and 8 MiB, 2 ranks
    python benchmarks/bench_scaling.py --out benchmarks/RESULTS.md      # ~9-10 min

The state is model-like: 8 fp32 weight matrices of 1024 columns with their biases (the parameters)
plus AdamW-like ``exp_avg``/``exp_avg_sq`` of the same shapes and a ``step`` scalar per parameter,
as nested dicts of plain tensors ({"model": ..., "optim": {"state": ...}}); no real model is
needed for the size scaling. Values are small integers and halves, so every update is exact.

The training job is emulated so that the host is free while the accelerator computes: one step =
a sleep (the compute) followed by an in-place ``add_(1)`` of every state tensor (the optimizer step:
the first moment the state changes, so a snapshot not yet taken must complete before it). The compute
lasts until the save just made is durable, and at least 0.1 s: every system's background work fits in
a step (the regime asynchronous checkpointing is for), so no save waits for the one before it. Since
that hides a system that writes from the live tensors, an untimed check per point saves once more and
updates at once, right where the system allows it, then compares what was saved (check 2).

The **stall** of a save is the time the training thread is blocked by checkpointing: the time inside
the save call plus any wait before the next in-place update. A save is made every step; each system
runs one untimed warm-up save (drained), then ``--saves`` timed ones; tables show the median and
min-max stall per save. The secondary metric, **durable**, is the time from the save call until the
save was committed (where the system tells).

bare copy          ``dst.copy_(src)`` of every tensor into buffers preallocated and faulted in at
                   set-up: the limit when the copy is not overlapped with compute. Each save copies
                   with the process's intra-op threads and with one; the faster counts.
ours               ``ckpt.CheckpointManager(dir, interval=1)`` (default: async ``double_buffer``),
                   ``save(step, state, force=True)``; ``manager.before_step()`` right before the
                   update (what ``attach(optimizer)`` calls from the optimizer's step pre-hook).
                   Durable: ``on_commit`` (rank 0, after the manifest's commit).
DCP async_save     ``dcp.async_save(state, storage_writer=FileSystemWriter(dir))``, no stager: the
 (default stager)  writer stages (a fresh copy inside the call). DCP allows one save in flight, so
                   the wait for the previous upload counts too. Durable: the upload future.
DCP async_save     the same with ``DefaultStager(StagingOptions(False, False, True, False))``
 (caching stager)  (cached staging storages, copy on a background thread) + the wait for
                   ``staging_completion`` before the update.
torch.save         ``torch.save(state, file)`` + ``fsync``, synchronous.
torchsnapshot      ``Snapshot.async_take(dir, {"state": StateDict(state)})``: it returns once every
                   tensor is cloned (staged), after which the state may change; one in flight, so
                   the wait for the previous one counts. Durable: ``PendingSnapshot.done()`` (its
                   metadata written; its file plug-in does not fsync).

Every system runs in its own fresh process per point (forked from this one after the imports, so the
state and buffers of one never share a heap with another): the size axis in one process per size, the
ranks axis as N processes on gloo over loopback (state of ``--ranks-mb`` split evenly, each rank saving
its row-shards under rank-distinct keys; stall per save = the max over ranks).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue
import shutil
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from harness import Load, argument_parser, machine_description, median, remove, settle, work_dir  # first: sys.path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ckpt  # noqa: E402
import peers  # noqa: E402
from probes import meminfo, peak_rss, rss  # noqa: E402
from report import (  # noqa: E402
    command_line, goal, goal_line, metric, ms_span, provenance, publish, table_head, write_json,
)
from states import model_like_state, select, state_bytes, tensors, zeros_like  # noqa: E402
from tests.support.launch import free_port, loopback_interface  # noqa: E402  (shared with the tests)

torchsnapshot = peers.torchsnapshot_module()  # an optional peer (the bench extra)

BENCH_NAME = "scaling"
SECTION = "## Scaling: stall vs state size and ranks"
MiB = 1 << 20
MIN_STEP_S = 0.1
WARMUPS = 1  # untimed, drained saves before the timed ones (first-call costs: buffers, thread pools, caches)
DURABLE_TIMEOUT_S = 600
GOAL_COPY_RATIO = 0.05
GOAL_FLAT = 2.0
WORKER_TIMEOUT_S = 900

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message=".*torch.distributed.*not initialized.*")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
logging.getLogger("torchsnapshot").setLevel(logging.WARNING)


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
        t0 = time.perf_counter()
        self.dcp.wait_previous()
        t1 = time.perf_counter()
        path = self.dirs[step] = self.work / self.key / f"step-{step:06d}"
        upload = self.dcp.save(self.state, path)
        upload.add_done_callback(lambda _f, s=step: self.durable_at.__setitem__(s, time.perf_counter()))
        self.parts = {"wait previous": t1 - t0}

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
        self.stop = threading.Event()
        self.watching: list[tuple[int, Any]] = []
        # PendingSnapshot has no callback: a watcher notes when each one is done (5 ms resolution).
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        while not self.stop.is_set() or self.watching:
            for step, pending in list(self.watching):
                if pending.done():
                    self.durable_at[step] = time.perf_counter()
                    self.watching.remove((step, pending))
            time.sleep(0.005)

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        self.snapshot.wait_previous()
        t1 = time.perf_counter()
        path = self.dirs[step] = self.work / self.key / f"step-{step:06d}"
        pending = self.snapshot.take(path, {"state": torchsnapshot.StateDict(self.state)})
        self.watching.append((step, pending))
        self.parts = {"wait previous": t1 - t0}

    def drain(self) -> None:
        self.snapshot.drain()
        while self.watching:
            time.sleep(0.005)

    def load(self, step: int, template: dict) -> Any:
        """Entry by entry (``restore`` would read every entry, whatever the target holds)."""
        snapshot = torchsnapshot.Snapshot(str(self.dirs[step]))

        def read(node: Any, path: tuple) -> Any:
            if isinstance(node, dict):
                return {k: read(v, path + (k,)) for k, v in node.items()}
            return snapshot.read_object("/".join((str(self.ctx.rank), "state", *path)), obj_out=torch.zeros_like(node))

        return read(template, ())

    def close(self) -> None:
        self.stop.set()
        self.watcher.join()


SYSTEMS = {s.key: s for s in (BareCopy, Ours, DCPDefault, DCPCaching, TorchSave, TorchSnapshot)}


# ---------------------------------------------------------------------------------------------
# One system, one point (runs in a fresh forked process; one per rank on the ranks axis)
# ---------------------------------------------------------------------------------------------
def sync(ctx: Ctx) -> None:
    """Line the ranks up before a save, as the step's gradient all-reduce does in a real job."""
    if ctx.distributed:
        dist.barrier()


def until_durable(system: System, step: int) -> float:
    """Sleep until ``step`` is durable (where this rank is told); returns the seconds slept."""
    if not system.tells_durable:
        return 0.0
    start = time.perf_counter()
    while step not in system.durable_at:
        if time.perf_counter() - start > DURABLE_TIMEOUT_S:
            raise TimeoutError(f"save of step {step} not durable after {DURABLE_TIMEOUT_S} s")
        time.sleep(0.002)
    return time.perf_counter() - start


def contract_check(system: System, state: dict, step: int, ctx: Ctx) -> bool:
    """One more save, untimed, of layer 0 only (1/8 of the state, same tensor sizes), with the update
    right where the system allows it: after the call and ``before_step()``, no compute in between.
    Whether the save holds the state at the call (the timed loop's compute, lasting until the save is
    durable, would hide a system that writes from the live tensors)."""
    part = first_layer(state)
    system.state = part
    try:
        sync(ctx)
        system.save(step)
        system.before_step()
        update(part)
        system.drain()
        return equal_after_update(system.load(step, part), part)
    finally:
        system.state = state


def measure(key: str, nbytes: int, saves: int, verify: bool, work: Path, ctx: Ctx) -> dict:
    """A warm-up save (drained), then ``saves`` timed steps of save -> compute -> wait -> update."""
    rss0 = rss()
    state = model_like_state(nbytes, ctx.rank, ctx.world)
    system = SYSTEMS[key](state, work, ctx)
    out: dict[str, Any] = {"rank": ctx.rank, "state_bytes": state_bytes(state), "records": []}
    system.setup()
    try:
        out["warmup"] = []
        for step in range(1, WARMUPS + 1):
            sync(ctx)
            t0 = time.perf_counter()
            system.save(step)
            t1 = time.perf_counter()
            system.drain()
            t2 = time.perf_counter()
            update(state)
            out["warmup"].append({"in_save": t1 - t0, "after_return": t2 - t1})
        out["compute"] = []
        starts = {}
        timed = range(WARMUPS + 1, WARMUPS + saves + 1)
        for step in timed:
            system.prune(step - 1)
            sync(ctx)
            start = starts[step] = time.perf_counter()
            counted = system.save(step)
            in_save = time.perf_counter() - start if counted is None else counted
            parts = dict(system.parts)
            c0 = time.perf_counter()  # the accelerator computes, the host is free: until the save is durable
            time.sleep(MIN_STEP_S)
            until_durable(system, step)
            out["compute"].append(time.perf_counter() - c0)
            w0 = time.perf_counter()
            system.before_step()
            wait = time.perf_counter() - w0
            update(state)
            out["records"].append({"in_save": in_save, "wait": wait, "stall": in_save + wait, "parts": parts})
        t = time.perf_counter()
        system.drain()
        out["drain_s"] = time.perf_counter() - t
        out["host_bytes"] = system.host_bytes()  # before the checks, which stage other layouts
        for step, rec in zip(timed, out["records"]):
            done = system.durable_at.get(step)
            rec["durable"] = None if done is None else done - starts[step]
        if system.writes:
            if verify:  # the whole state, as the last timed save holds it
                out["verified"] = equal_after_update(system.load(timed[-1], state), state)
            out["consistent"] = contract_check(system, state, timed[-1] + 1, ctx)
    finally:
        system.close()
    out["peak_rss_growth"] = peak_rss() - rss0
    return out


def _worker(results, key: str, nbytes: int, saves: int, verify: bool, work: str, rank: int, world: int,
            port: int | None) -> None:
    ctx = Ctx(rank, world, port is not None)
    try:
        if ctx.distributed:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=WORKER_TIMEOUT_S))
        out = measure(key, nbytes, saves, verify, Path(work), ctx)
        if ctx.distributed:
            dist.barrier()
            dist.destroy_process_group()
        results.put(out)
    except BaseException as exc:  # reported in the table; the other ranks are ended by the parent
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})


def run_point(key: str, nbytes: int, saves: int, verify: bool, work: Path, world: int | None) -> list[dict]:
    """``key`` at one point in fresh forked processes: one (``world`` None: no process group) or
    ``world`` ranks on gloo. Returns each rank's result (or error)."""
    ctx = mp.get_context("fork")  # after the imports: a fresh heap per point without re-importing torch
    results = ctx.Queue()
    port = free_port() if world is not None else None
    procs = [ctx.Process(target=_worker, args=(results, key, nbytes, saves, verify, str(work), r, world or 1, port))
             for r in range(world or 1)]
    for p in procs:
        p.start()
    got: list[dict] = []
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    error_seen = None
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=1.0))
            if "error" in got[-1] and error_seen is None:
                error_seen = time.monotonic()
        except queue.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        late = error_seen is not None and time.monotonic() - error_seen > 20  # the others wait in collectives
        if time.monotonic() > deadline or late or (dead and results.empty() and len(got) < len(procs)):
            for p in procs:
                if p.is_alive():
                    p.kill()
            reason = "timed out" if time.monotonic() > deadline else "another rank failed" if late else "exited"
            seen = {g["rank"] for g in got}
            got += [{"rank": r, "error": reason} for r in range(len(procs)) if r not in seen]
            break
    for p in procs:
        p.join()
    remove(work / key)
    return sorted(got, key=lambda g: g["rank"])


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------
@dataclass
class Point:
    key: str
    x: int  # state bytes (size axis) or ranks
    state_bytes: int = 0
    stalls: list[float] = field(default_factory=list)  # per save (max over ranks)
    durables: list[float] = field(default_factory=list)  # per save (max over ranks, where known)
    parts: dict[str, list[float]] = field(default_factory=dict)  # named parts of the stall, per save (max over ranks)
    compute: list[float] = field(default_factory=list)  # per save: the emulated compute (max over ranks)
    verified: bool | None = None  # the last timed save, loaded back whole, equals the state at save time
    consistent: bool | None = None  # the contract check (see contract_check), on every rank
    peak_rss_growth: int = 0
    host_buffer_bytes: int | None = None
    error: str | None = None


def summarize(key: str, x: int, ranks: list[dict]) -> Point:
    point = Point(key, x)
    errors = [r for r in ranks if "error" in r]
    if errors:
        point.error = errors[0]["error"]
        if errors[0].get("traceback"):
            print(errors[0]["traceback"], file=sys.stderr, flush=True)
        return point
    point.state_bytes = sum(r["state_bytes"] for r in ranks)
    per_save = list(zip(*[r["records"] for r in ranks]))
    point.stalls = [max(rec["stall"] for rec in recs) for recs in per_save]
    point.parts["in save"] = [max(rec["in_save"] for rec in recs) for recs in per_save]
    point.parts["wait before update"] = [max(rec["wait"] for rec in recs) for recs in per_save]
    for recs in per_save:
        known = [rec["durable"] for rec in recs if rec["durable"] is not None]
        if known:
            point.durables.append(max(known))
        for name in recs[0]["parts"]:
            if all(name in rec["parts"] for rec in recs):
                point.parts.setdefault(name, []).append(max(rec["parts"][name] for rec in recs))
    point.compute = [max(c) for c in zip(*[r["compute"] for r in ranks])]
    checks = [r["verified"] for r in ranks if "verified" in r]
    point.verified = all(checks) if checks else None
    contracts = [r["consistent"] for r in ranks if "consistent" in r]
    point.consistent = all(contracts) if contracts else None
    point.peak_rss_growth = max(r["peak_rss_growth"] for r in ranks)
    buffers = [r["host_bytes"] for r in ranks if r.get("host_bytes") is not None]
    point.host_buffer_bytes = sum(buffers) if buffers else None
    return point


def print_point(p: Point, what: str, wall: float) -> None:
    if p.error:
        print(f"{what:>12s} {SYSTEMS[p.key].label:34s} FAILED: {p.error}", flush=True)
        return
    durable = f" durable {median(p.durables):.3f}s" if p.durables else ""
    check = "" if p.verified is None else f" verified {'OK' if p.verified else 'MISMATCH'}"
    check += "" if p.consistent is None else f" contract {'OK' if p.consistent else 'INCONSISTENT'}"
    print(f"{what:>12s} {SYSTEMS[p.key].label:34s} stall median {median(p.stalls) * 1e3:9.1f} ms ["
          + " ".join(f"{s * 1e3:.1f}" for s in p.stalls) + f"] compute {median(p.compute):.2f}s{durable}{check} "
          f"({wall:.1f}s, load {os.getloadavg()[0]:.1f})", flush=True)


def size_label(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / MiB:.0f} MiB"


def axis_table(points: dict[str, list[Point]], columns: list[str], durable: bool = False) -> list[str]:
    """Rows systems, a 'median (min–max)' column per point, then (stall) a column per point of the
    median ÷ bare copy's median in the same run."""
    copy = points.get("copy")
    ratios = not durable and copy is not None
    names = ["System", *columns, *([f"× bare copy, {c}" for c in columns] if ratios else [])]
    lines = table_head(names, "l" + "r" * (len(names) - 1))
    for key, row in points.items():
        if durable and not SYSTEMS[key].writes:
            continue
        cells = [f"failed: {p.error}" if p.error else ms_span(p.durables if durable else p.stalls)
                 + (" **inconsistent**" if p.verified is False or p.consistent is False else "") for p in row]
        if ratios:
            cells += ["–" if r is None else f"{r:.3f}" for r in ratio_over(points, key)]
        lines.append(f"| {SYSTEMS[key].label} | " + " | ".join(cells) + " |")
    return lines


def ratio_over(points: dict[str, list[Point]], key: str) -> list[float | None]:
    """Median stall of ``key`` ÷ bare copy's, per point."""
    out = []
    for p, c in zip(points.get(key, []), points.get("copy", [])):
        ok = not p.error and not c.error and p.stalls and c.stalls
        out.append(median(p.stalls) / median(c.stalls) if ok else None)
    return out


def goals(sizes: dict[str, list[Point]]) -> list[dict]:
    """Ours against bare copy at every size, and ours' stall from the smallest size to the largest."""
    out = []
    ratios = ratio_over(sizes, "ours")
    xs = [p.x for p in sizes.get("copy", [])]
    if ratios and None not in ratios:
        worst = max(ratios)
        at = xs[ratios.index(worst)]
        pairs = zip(xs, ratios, sizes["ours"], sizes["copy"])
        detail = ("median stall of ours ÷ median of bare copy, worst over sizes (at " + size_label(at) + "); per size: "
                  + ", ".join(f"{size_label(x)} {median(o.stalls) * 1e3:.1f} / {median(c.stalls) * 1e3:.1f} ms = {r:.3f}"
                              for x, r, o, c in pairs))
        out.append(goal(f"stall ≤ {GOAL_COPY_RATIO}× bare copy at every size", worst, GOAL_COPY_RATIO, "<=", detail))
    else:
        out.append(goal(f"stall ≤ {GOAL_COPY_RATIO}× bare copy at every size", None, GOAL_COPY_RATIO, "<=",
                        "not measured (ours or bare copy missing or failed)"))
    ours = [p for p in sizes.get("ours", []) if not p.error]
    name = f"ours' stall flat in state size (largest ÷ smallest ≤ {GOAL_FLAT})"
    if len(ours) >= 2 and len(ours) == len(sizes["ours"]):
        lo, hi = ours[0], ours[-1]
        flat = median(hi.stalls) / median(lo.stalls)
        copy = {p.x: p for p in sizes.get("copy", []) if not p.error}
        copy_growth = (f"; bare copy grew {median(copy[hi.x].stalls) / median(copy[lo.x].stalls):.1f}× over the same "
                       "sizes" if lo.x in copy and hi.x in copy else "")
        detail = (f"ours' median stall {median(hi.stalls) * 1e3:.1f} ms at {size_label(hi.state_bytes)} ÷ "
                  f"{median(lo.stalls) * 1e3:.1f} ms at {size_label(lo.state_bytes)}, while the state grew "
                  f"{hi.state_bytes / lo.state_bytes:.1f}×{copy_growth}")
        out.append(goal(name, flat, GOAL_FLAT, "<=", detail))
    else:
        out.append(goal(name, None, GOAL_FLAT, "<=", "not measured (fewer than two sizes, or a size failed)"))
    return out


def metrics_of(sizes: dict[str, list[Point]], ranks: dict[str, list[Point]], ranks_bytes: int) -> list[dict]:
    """stall_s and durable_s per system and point; ``axis`` tells the curves apart, ``consistent`` is
    check 2's result (False: the save did not snapshot the state)."""
    out = []
    for axis, points in (("size", sizes), ("ranks", ranks)):
        for key, row in points.items():
            for p in row:
                if p.error:
                    continue
                extra = {"axis": axis, **({"state_bytes": p.state_bytes or ranks_bytes} if axis == "ranks" else {}),
                         **({"consistent": p.consistent} if p.consistent is not None else {})}
                x = p.state_bytes if axis == "size" else p.x
                out.append(metric(SYSTEMS[key].label, "stall_s", "s", p.stalls, x=x, **extra))
                if p.durables:
                    out.append(metric(SYSTEMS[key].label, "durable_s", "s", p.durables, x=x, **extra))
    return out


def series_of(sizes: dict[str, list[Point]], ranks: dict[str, list[Point]]) -> dict:
    """Median per point, per system: the curves of the plots."""
    out: dict[str, dict] = {}
    for axis, points, xof in (("size", sizes, lambda p: p.state_bytes), ("ranks", ranks, lambda p: p.x)):
        for name, attr in (("stall", "stalls"), ("durable", "durables")):
            curves = {SYSTEMS[k].label: [[xof(p), median(getattr(p, attr))] for p in row
                                         if not p.error and getattr(p, attr)] for k, row in points.items()}
            curves = {k: v for k, v in curves.items() if v}
            if curves:
                out[f"{name}_s_vs_{axis}"] = curves
    return out


def report(sizes: dict[str, list[Point]], ranks: dict[str, list[Point]], info: dict, args: argparse.Namespace,
           command: str, goal_list: list[dict]) -> str:
    body = [
        SECTION,
        "",
        "How the checkpoint stall grows with the state and with the ranks, one row per system, all measured in this "
        "run. State: 8 fp32 weight matrices of 1024 columns with biases, plus AdamW-like `exp_avg`/`exp_avg_sq` of "
        "the same shapes and a `step` scalar each (weights + optimizer state, plain tensors in nested dicts). "
        "**The job emulates an accelerator job whose host is free while the device computes**: one step = "
        f"a sleep (the compute) then an in-place `add_(1)` of every state tensor (the optimizer step: the "
        f"first moment the state changes, so a snapshot not yet taken must finish first, and what was saved can be "
        f"checked against the state at save time). The compute lasts until the save just made is durable (at least "
        f"{MIN_STEP_S} s): each system's background work fits in a step, so no save waits for the one before it (the "
        "regime asynchronous checkpointing is for; back-pressure is not measured here). A save every step: one untimed, "
        "drained warm-up save (first-call costs: buffers, thread pools, caches), then "
        f"{args.saves} timed ones. **Stall** = time inside the save call + time waited before the next update, on "
        "the training thread; cells are **milliseconds, median (min–max) over the saves**; *× bare copy* divides "
        "medians. Each system runs in a fresh process per point (forked after the imports).",
        "",
        "### Stall per save vs state size (1 process)",
        "",
        *axis_table(sizes, [size_label(p.state_bytes or p.x) for p in next(iter(sizes.values()), [])]),
        "",
        "Time until the save was durable/committed, ms from the save call (secondary):",
        "",
        *axis_table(sizes, [size_label(p.state_bytes or p.x) for p in next(iter(sizes.values()), [])], durable=True),
        "",
    ]
    if ranks:
        body += [
            f"### Stall per save vs ranks ({size_label(info['ranks_bytes'])} in total, sharded evenly)",
            "",
            f"N processes on one machine, gloo over loopback (`init_process_group` on 127.0.0.1), "
            f"`torch.set_num_threads(max(1, {os.cpu_count()} // N))`; each rank holds 1/N of every matrix's rows "
            "(plain tensors under rank-distinct keys) and saves them; the ranks line up with a barrier before each "
            "save (the step's all-reduce), and a save's stall is the **max over ranks** of each rank's stall (durable: "
            f"the max where known). **This machine has {os.cpu_count()} cores: 4 ranks are oversubscribed** (each "
            "rank's training thread, staging and writer threads share the cores with the others'), so the 4-rank "
            "column measures contention as much as scaling. With ≥ 2 ranks ours' `save()` holds one small collective "
            "(the ranks agree on failures, free buffers and deltas), so its stall includes waiting for the slowest rank "
            "to reach `save()`; DCP's planning collectives run in its upload thread, torch.save has none.",
            "",
            *axis_table(ranks, [f"{p.x} rank{'s' if p.x > 1 else ''}" for p in next(iter(ranks.values()), [])]),
            "",
            "Time until durable/committed, ms (secondary):",
            "",
            *axis_table(ranks, [f"{p.x} rank{'s' if p.x > 1 else ''}" for p in next(iter(ranks.values()), [])],
                        durable=True),
            "",
        ]
    body += ["Goals:", ""]
    body += [goal_line(g) for g in goal_list]
    body += ["", "Notes:", ""]
    body += [f"- *{SYSTEMS[k].label}*: {SYSTEMS[k].note}." for k in {**sizes, **ranks}]
    body += notes(sizes, ranks, info)
    body += ["", *provenance(info["machine"], command, load=info["load"], extra=info["extra"])]
    return "\n".join(body)


def notes(sizes: dict[str, list[Point]], ranks: dict[str, list[Point]], info: dict) -> list[str]:
    out = []
    steps = []
    for axis, points, label in (("size", sizes, lambda p: size_label(p.state_bytes or p.x)),
                                ("ranks", ranks, lambda p: f"{p.x}r")):
        for k, row in points.items():
            ok = [p for p in row if not p.error]
            if ok:
                steps.append(f"{SYSTEMS[k].label} ({axis}): " + ", ".join(
                    f"{label(p)} {median(p.compute):.2f}" for p in ok))
    out.append("- Emulated compute per step (until the save was durable, at least "
               f"{MIN_STEP_S} s), median s: " + "; ".join(steps) + ".")
    def label_of(axis: str, p: Point) -> str:
        return size_label(p.state_bytes) if axis == "size" else f"{p.x} ranks"

    every = [(axis, k, p) for axis, pts in (("size", sizes), ("ranks", ranks)) for k, row in pts.items() for p in row]
    whole = [(a, k, p) for a, k, p in every if p.verified is not None]
    bad_whole = [f"{SYSTEMS[k].label} at {label_of(a, p)}" for a, k, p in whole if not p.verified]
    out.append("- Check 1, outside the timing: the last timed save, loaded back whole (ours: `manager.load(step=, "
               "strict=False)`; DCP: `dcp.load`; torch.save: `torch.load`; torchsnapshot: `Snapshot.read_object` per "
               "entry), equals the state at save time, bit for bit, on every rank; run at the smallest size and at the "
               f"most ranks ({len(whole)} points): "
               + ("all equal." if not bad_whole else "**mismatch**: " + "; ".join(bad_whole) + "."))
    contract = [(a, k, p) for a, k, p in every if p.consistent is not None]
    bad = [f"{SYSTEMS[k].label} at {label_of(a, p)}" for a, k, p in contract if not p.consistent]
    out.append("- Check 2, the snapshot contract, at every point: one more save, untimed, of layer 0 (weight, bias and "
               "their optimizer state: 1/8 of the state, the same tensor sizes), then the update at once, right where "
               "the system allows it (after the call and its pre-step wait; no compute in between), then loaded back "
               f"and compared with the state at the call ({len(contract)} points): "
               + ("all consistent." if not bad else "**inconsistent** (cells marked so in the tables): "
                  + "; ".join(bad) + ". An inconsistent save holds values changed after its call returned: it did not "
                  "snapshot the state, so its stall leaves out the copy a consistent checkpoint needs. In the timed loop "
                  "the compute lasts until the save is durable, which hides this."))
    waits = {}
    for points in (sizes, ranks):
        for k, row in points.items():
            for p in row:
                if "wait previous" in p.parts and not p.error:
                    waits[k] = max(waits.get(k, 0.0), median(p.parts["wait previous"]))
    if waits:
        out.append("- Of the peers' stall, the wait for their previous save (one in flight; the compute rule keeps it "
                   "near 0), largest median over the points: "
                   + "; ".join(f"{SYSTEMS[k].label} {v * 1e3:.1f} ms" for k, v in waits.items()) + ".")
    split = [f"{SYSTEMS[k].label} {median(p.parts['in save']) * 1e3:.1f} + {median(p.parts['wait before update']) * 1e3:.1f}"
             for k, row in sizes.items() if row and not row[-1].error and SYSTEMS[k].writes for p in [row[-1]]]
    if split:
        out.append(f"- The stall's two parts at {size_label(sizes['ours'][-1].state_bytes) if sizes.get('ours') else 'the largest size'}, "
                   "median ms, in the save call + waited before the update: " + "; ".join(split) + ".")
    copies = [f"{size_label(p.state_bytes)} " + " / ".join(f"{median(v) * 1e3:.1f} ({name})" for name, v in p.parts.items()
                                                         if "thread" in name)
              for p in sizes.get("copy", []) if not p.error]
    if copies:
        out.append("- Bare copy, both copies of each save (median ms; the row counts the faster per save): "
                   + "; ".join(copies) + ".")
    big = [(k, row[-1]) for k, row in sizes.items() if row and not row[-1].error]
    if big:
        p0 = big[0][1]
        out.append(f"- Peak RSS growth of the process at {size_label(p0.state_bytes)} (state included), GiB: "
                   + "; ".join(f"{SYSTEMS[k].label} {p.peak_rss_growth / 2**30:.2f}" for k, p in big)
                   + (f"; ours' host buffers (`stats.host_buffer_bytes`) "
                      f"{next(p.host_buffer_bytes for k, p in big if k == 'ours') / p0.state_bytes:.2f}× the state"
                      if any(k == "ours" and p.host_buffer_bytes for k, p in big) else "") + ".")
    failed = [f"{SYSTEMS[k].label} at {p.x}: {p.error}" for pts in (sizes, ranks) for k, row in pts.items()
              for p in row if p.error]
    if failed:
        out.append("- Failed points: " + "; ".join(failed) + ".")
    out.append("- On this CPU-only box the background copy and write share the 2 cores with the `add_` update and "
               "with other processes; the sleep stands for device compute, during which a real host is idle. A sync "
               "system's stall does not depend on the step length; an async one's does only when its background "
               "work outlasts the step.")
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace, work: Path) -> tuple[dict, dict]:
    sizes: dict[str, list[Point]] = {k: [] for k in args.systems}
    ranks: dict[str, list[Point]] = {k: [] for k in args.systems} if args.ranks else {}
    for i, mb in enumerate(args.sizes_mb):
        for key in args.systems:
            t = time.perf_counter()
            ranks_out = run_point(key, int(mb * MiB), args.saves, i == 0, work, None)
            point = summarize(key, int(mb * MiB), ranks_out)
            print_point(point, size_label(int(mb * MiB)), time.perf_counter() - t)
            sizes[key].append(point)
        settle()
    for n in args.ranks:
        for key in args.systems:
            t = time.perf_counter()
            ranks_out = run_point(key, int(args.ranks_mb * MiB), args.saves, n == max(args.ranks), work, n)
            point = summarize(key, n, ranks_out)
            print_point(point, f"{n} ranks", time.perf_counter() - t)
            ranks[key].append(point)
    return sizes, ranks


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__, keep=True)
    parser.add_argument("--quick", action="store_true",
                        help="32, 64 and 128 MiB, 64 MiB over 1/2 ranks, 2 timed saves (~25 s on a quiet box)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' smoke run: 4 and 8 MiB, 8 MiB over 2 ranks, 1 timed save")
    parser.add_argument("--sizes-mb", type=float, nargs="+",
                        help="state sizes in MiB, one fresh process per size (default 256 512 1024 2048 4096)")
    parser.add_argument("--ranks", type=int, nargs="*", help="rank counts (default 1 2 4; quick 1 2; none: skip the ranks axis)")
    parser.add_argument("--ranks-mb", type=float, help="total state in MiB on the ranks axis (default 1024; quick 64)")
    parser.add_argument("--saves", type=int, help="timed saves per point (default 3; quick 2)")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS),
                        help="systems to run (default all; bare copy is the ratios' reference)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes_mb, args.ranks, args.ranks_mb, args.saves = [4, 8], [2], 8, 1
    args.sizes_mb = args.sizes_mb or ([32, 64, 128] if args.quick else [256, 512, 1024, 2048, 4096])
    args.ranks = ([1, 2] if args.quick else [1, 2, 4]) if args.ranks is None else args.ranks
    args.ranks_mb = args.ranks_mb or (64 if args.quick else 1024)
    args.saves = args.saves or (2 if args.quick else 3)
    args.sizes_mb = sorted(args.sizes_mb)
    if args.saves < 1 or min(args.sizes_mb) <= 0 or any(n < 1 for n in args.ranks) or args.ranks_mb <= 0:
        parser.error("--saves, --sizes-mb, --ranks and --ranks-mb must be positive")
    if "torchsnapshot" in args.systems and torchsnapshot is None:
        print("torchsnapshot is not installed: skipped (pip install torchsnapshot)", flush=True)
        args.systems.remove("torchsnapshot")

    need = 3 * max(args.sizes_mb) * MiB  # the state + ours' two host buffer sets
    available = meminfo().get("MemAvailable")
    if available is not None and need > available:
        print(f"warning: the largest point may need {need / 2**30:.1f} GiB of memory; "
              f"{available / 2**30:.1f} GiB is available", flush=True)
    command = command_line("bench_scaling.py", argv)
    t0 = time.perf_counter()
    load = Load(processes=True)
    with work_dir(args.dir, "scaling-", keep=args.keep) as work:
        print(f"work dir: {work}", flush=True)
        machine = machine_description(work, [f"torch threads {torch.get_num_threads()}",
                                             f"torchsnapshot {getattr(torchsnapshot, '__version__', 'missing')}"])
        sizes, ranks = run(args, work)
    wall = time.perf_counter() - t0
    info = {"machine": machine, "load": load.stop().describe("during the run"),
            "ranks_bytes": int(args.ranks_mb * MiB), "extra": [f"Wall time of the run: {wall:.0f} s"]}
    goal_list = goals(sizes)
    section = report(sizes, ranks, info, args, command, goal_list)
    publish(section, args.out)
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics_of(sizes, ranks, info["ranks_bytes"]),
               goals=goal_list, series=series_of(sizes, ranks),
               params={"sizes_mib": args.sizes_mb, "ranks": args.ranks, "ranks_mib": args.ranks_mb,
                       "saves": args.saves, "systems": args.systems, "compute_rule":
                       f"until the save is durable, at least {MIN_STEP_S} s", "wall_s": round(wall, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

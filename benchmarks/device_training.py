"""The snapshot sections of ``device_checks.py``: what a save costs a real job on the device.

Both time a save the way :meth:`device_job.Job.timed` does: ``sync; t0; save; forward/backward;
before_optimizer; optimizer step; sync; t1`` against a plain step timed the same way right before
it, so the copy a save starts is inside the window; buffers are allocated and processes started by
warm-up saves before anything is timed.

* :func:`overlap`: our ``DoubleBufferStager`` alone (both buffer sets warmed) with pinned buffers,
  pageable buffers, and with the host ahead of the device (one unsynchronised step before the save,
  against two plain steps): step time lost, host time in ``stage()``, the copy's device time (events
  on the copy stream) and the compute stream's wait (events on it). Then a separate repeat under
  the profiler: the fraction of the DtoH copy time that ran beside kernels of another stream
  (:func:`copy_overlap`), and the staged state against a device clone taken at the save.
* :func:`stall`: per save, ours (the manager) vs what torchtitan runs for
  ``async_with_pinned_mem`` (:class:`device_savers.TitanCalls`) vs DCP's default ``async_save``:
  step time lost, host time in the save call, each saver's waits (``device_savers``: our copy and
  compute-stream wait; DCP's staging, the wait for it, the upload), the previous save's write still
  running ``--every`` steps later (drained before the timed pair, so that the save's own stall is
  not mixed with back-pressure; the training loop of ``device_trainer`` keeps both),
  the first (allocating, process-starting) save apart; a save every ``--every`` steps; and whether
  DCP's staged bytes equal the state at a save made with the host ahead of the device
  (:func:`dcp_staged_bytes_hold`).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import time
from pathlib import Path

from device_job import CopyTimes, Job
from device_savers import DCPDefault, Ours, TitanCalls, titan_cannot_run
from device_setup import GIB, Context, Failed, Skipped
from harness import median


def state_tree(job: Job) -> dict:
    from ckpt.state import export_state

    return export_state(job.state())[0]


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def tensor_leaves(tree) -> list:
    from ckpt.tree import leaves

    return [v for v in leaves(tree) if hasattr(v, "shape") and hasattr(v, "dtype")]


MODES = (("pinned", "pinned", 0), ("pageable", "pageable", 0), ("host-ahead", "pinned", 1))  # mode, buffers, lead


def overlap(ctx: Context, figures: dict) -> None:
    job = Job(ctx)
    for _ in range(3):
        job.step()
    copies = CopyTimes(ctx)
    stagers = {"pinned": copies.stager(ctx.device_type, pin_memory=ctx.accel is not None),
               "pageable": copies.stager(ctx.device_type, pin_memory=False)}
    figures.update(params_millions=round(job.params / 1e6, 1), repeats=1 if ctx.dry else 3)
    try:
        for buffers, stager in stagers.items():  # both sets of each allocated before anything is timed
            for _ in range(2):
                stager.stage(state_tree(job)).result()
                stager.wait_snapshot(host=True)
        figures["state_gib"] = round(stagers["pinned"].host_bytes / 2 / GIB, 2)
        for mode, buffers, lead in MODES:
            timed_repeats(ctx, job, stagers[buffers], copies, mode, lead, figures)
            verify_and_profile(ctx, job, stagers[buffers], mode, lead, figures)
    finally:
        for stager in stagers.values():
            stager.close()
    unequal = [mode for mode, _, _ in MODES if not figures[f"{mode}_state_equal"]]
    if unequal:
        raise Failed(f"{unequal}: the snapshot differs from the state at the save")


def timed_repeats(ctx: Context, job: Job, stager, copies: CopyTimes, mode: str, lead: int, figures: dict) -> None:
    lost, calls, copy_ms, waits = [], [], [], []
    copies.take_ms()  # a copy of an earlier mode's check is not this mode's
    for _ in range(figures["repeats"]):
        plain, _ = job.timed(lead=lead)
        waited = stager.device_stall_s
        saved, call = job.timed(save=lambda: stager.stage(state_tree(job)), before_optimizer=stager.wait_snapshot,
                                lead=lead)
        stager.wait_snapshot(host=True)
        lost.append(saved - plain)
        calls.append(call)
        copy_ms.append(copies.take_ms())
        waits.append(1e3 * (stager.device_stall_s - waited))
        figures.setdefault(f"{mode}_plain_ms", round(1e3 * plain, 2))
    figures[f"{mode}_step_lost_ms"] = round(1e3 * median(lost), 2)
    figures[f"{mode}_stage_call_ms"] = round(1e3 * median(calls), 2)
    figures[f"{mode}_copy_ms"] = round(median(copy_ms), 2)
    figures[f"{mode}_compute_wait_ms"] = round(median(waits), 2)


def verify_and_profile(ctx: Context, job: Job, stager, mode: str, lead: int, figures: dict) -> None:
    """One more save, apart from the timed ones: under the profiler, with a device clone of the state
    taken at the save (on the compute stream) to compare the staged bytes with."""
    torch = ctx.torch
    taken = {}

    def save_with_reference() -> None:
        tree = state_tree(job)
        taken["reference"] = [local(t).detach().clone() for t in tensor_leaves(tree)]
        taken["future"] = stager.stage(tree)

    trace = ctx.work / f"trace-{mode}.json"
    with profiler(ctx) as prof:
        job.timed(save=save_with_reference, before_optimizer=stager.wait_snapshot, lead=lead)
    staged = tensor_leaves(taken["future"].result())
    stager.wait_snapshot(host=True)
    figures[f"{mode}_state_equal"] = len(staged) == len(taken["reference"]) and all(
        torch.equal(local(s), r.cpu()) for s, r in zip(staged, taken["reference"]))
    del taken["reference"]
    if prof is not None:
        prof.export_chrome_trace(str(trace))
        figures[f"{mode}_copy_overlapped_fraction"] = copy_overlap(trace)
        if mode == "pinned":
            with open(trace, "rb") as src, gzip.open(ctx.out / "trace-pinned.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        trace.unlink()


def profiler(ctx: Context):
    if ctx.device_type != "cuda":
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def copy_overlap(trace: Path) -> float:
    """Of the device-to-host copy time, the fraction during which a kernel ran on another stream."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    copies = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events
              if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "") and e.get("dur")]
    kernels = [(e["ts"], e["ts"] + e["dur"], e.get("tid")) for e in events if e.get("cat") == "kernel" and e.get("dur")]
    total = sum(end - start for start, end, _ in copies)
    covered = 0.0
    for start, end, stream in copies:
        spans = sorted((max(s, start), min(e, end)) for s, e, t in kernels if t != stream and s < end and e > start)
        reach = start
        for s, e in spans:
            s = max(s, reach)
            if e > s:
                covered, reach = covered + e - s, e
    return round(covered / total, 3) if total else 0.0


SYSTEMS = {"ours": Ours, "titan": TitanCalls, "dcp-default": DCPDefault}


def stall(ctx: Context, figures: dict) -> None:
    if ctx.room_for < 3:
        raise Skipped("the work folder holds fewer than 3 checkpoints")
    job = Job(ctx)
    for _ in range(3):
        job.step()
    every, saves = ctx.args.every, (2 if ctx.dry else 3)
    figures.update(every=every, timed_saves=saves)
    for system, make in SYSTEMS.items():
        # DCP's default last, and only with time to spare for the sections after this one
        if ctx.left() < (120 if system == "dcp-default" else 40):
            figures[system] = "skipped: budget"
            continue
        if system == "titan" and titan_cannot_run(ctx):
            figures[system] = titan_cannot_run(ctx)
            continue
        root = ctx.work / f"stall-{system}"
        shutil.rmtree(root, ignore_errors=True)
        saver = make(ctx, job, root)
        try:
            figures[system] = measure_saves(ctx, job, saver, every, saves)
            if isinstance(saver, TitanCalls):
                figures[system]["staged_equal_host_ahead"] = dcp_staged_bytes_hold(ctx, job, saver)
        finally:
            saver.close()
            shutil.rmtree(root, ignore_errors=True)
        figures[system].update(saver.notes)


def measure_saves(ctx: Context, job: Job, saver, every: int, saves: int) -> dict:
    entry = {"label": saver.label}
    step = 0

    def save() -> None:
        saver.save(step)

    # Warm-up saves back to back (ours: the second finds the first set still being written and
    # allocates the other), then drained: buffers allocated, processes started; the first apart.
    for n in range(saver.warm_saves):
        step += 1
        seconds, call = job.timed(save=save, before_optimizer=saver.before_optimizer)
        saver.settle()
        if n == 0:
            entry.update(first_save_step_s=round(seconds, 3), first_save_call_s=round(call, 3))
    drained = time.perf_counter()
    saver.drain()
    entry["warm_up_drain_s"] = round(time.perf_counter() - drained, 3)
    if isinstance(saver, Ours):  # both sets now: host_buffer_gib at the end must not have grown
        entry["buffer_gib_after_warm_up"] = round(saver.manager.stats.host_buffer_bytes / GIB, 2)
    saver.marks = type(saver.marks)()
    plains, lost, calls, left = [], [], [], []
    for _ in range(saves):
        for _ in range(every - 2):
            job.step(saver.before_optimizer)
        drained = time.perf_counter()  # the previous write's rest: the drain, apart from the save's stall
        saver.drain()
        left.append(time.perf_counter() - drained)
        plain, _ = job.timed(before_optimizer=saver.before_optimizer)
        step += 1
        saved, call = job.timed(save=save, before_optimizer=saver.before_optimizer)
        saver.settle()
        plains.append(plain)
        lost.append(saved - plain)
        calls.append(call)
    drained = time.perf_counter()
    saver.drain()
    entry.update(plain_step_ms=round(1e3 * median(plains), 2), step_lost_ms=round(1e3 * median(lost), 2),
                 save_call_ms=round(1e3 * median(calls), 2), last_drain_s=round(time.perf_counter() - drained, 3),
                 previous_write_left_ms=round(1e3 * median(left), 2))
    entry.update({name: round(median(values), 3) for name, values in saver.marks.items() if values})
    return entry


def dcp_staged_bytes_hold(ctx: Context, job: Job, saver: TitanCalls) -> bool:
    """One more save by torchtitan's calls with the host ahead of the device, as a training loop
    saves (right after the optimizer step, no synchronize): DCP's staged bytes against a device clone
    of the state queued on the compute stream at the save. DCP's stager copies on a stream of its
    own that is not ordered after the compute stream (torch 2.11 ``DefaultStager._stage``), so this
    is where a stale copy would show."""
    torch = ctx.torch
    taken = {}
    job.step()
    saver.save(1 << 20, at_save=lambda states: taken.update(
        reference=[local(t).detach().clone() for t in tensor_leaves(states)]))
    staged = tensor_leaves(saver.stager.last.result())
    saver.before_optimizer()
    saver.drain()
    return len(staged) == len(taken["reference"]) and all(
        torch.equal(local(s), r.cpu()) for s, r in zip(staged, taken["reference"]))

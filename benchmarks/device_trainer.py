"""The training-loop sections of ``device_checks.py``: the figures users ask for, and a resume.

* :func:`trainer`: the ~1B llama under FSDP2 on one rank in bf16 (:class:`device_job.Job`) trained
  by one loop three times over: without checkpoints, with ours (``ckpt.CheckpointManager``), and
  with torchtitan's ``CheckpointManager`` (``async_with_pinned_mem``; its DCP calls where torchtitan
  does not import) — a save every ``SAVE_EVERY`` steps, each halfway between two window ends so that
  every save's copy and staging fall inside the timed window. Per loop: tokens/s and MFU over the
  window (device synchronised at both ends), the saves in it, the drain after it, each saver's
  waits (``device_savers``), and tokens/s against the loop without checkpoints. Buffers are
  allocated and torchtitan's checkpoint process started by warm-up saves before the window, as a
  long run amortises them.
* :func:`resume`: the project's trainer (``trainer.train.Trainer``, in this process) on the device:
  the debug llama stopped after step 10 with checkpoints every 5, resumed to 20, and an
  uninterrupted run to 20; the losses after the resume against the uninterrupted run's (bitwise on
  the CPU of a dry run, which stops after step 2 of 4, checkpoints every 2, sequences of 32).
"""

from __future__ import annotations

import shutil
import time

from device_job import Job
from device_savers import Ours, titan_cannot_run, titan_saver
from device_setup import Context, Failed, Skipped

SAVE_EVERY = 10  # steps between saves in the loop (2 in a dry run: 3 saves in 6 steps)
WINDOWS = 3  # saves in the timed window


def trainer(ctx: Context, figures: dict) -> None:
    from trainer.device import device_name
    from trainer.metrics import peak_flops

    if ctx.room_for < 3:
        raise Skipped("the work folder holds fewer than 3 checkpoints")
    every = 2 if ctx.dry else SAVE_EVERY
    job = Job(ctx)
    peak = peak_flops(device_name(ctx.device_type)) if ctx.accel is not None else None
    figures.update(params_millions=round(job.params / 1e6, 1), tokens_per_step=job.tokens_per_step,
                   precision="fp32" if ctx.dry else "bf16 compute, fp32 master weights and AdamW (FSDP2 1 rank)",
                   save_every=every, window_steps=every * WINDOWS,
                   peak_tflops=None if peak is None else round(peak / 1e12, 1))
    loops = {"none": lambda root: None, "ours": lambda root: Ours(ctx, job, root),
             "titan": lambda root: titan_saver(ctx, job, root)}
    for name, make in loops.items():
        if ctx.left() < 40 or (name == "titan" and titan_cannot_run(ctx)):
            figures[name] = "skipped: budget" if ctx.left() < 40 else titan_cannot_run(ctx)
            continue
        root = ctx.work / f"loop-{name}"
        shutil.rmtree(root, ignore_errors=True)
        saver = make(root)
        try:
            entry = train_window(ctx, job, saver, every, peak)
        finally:
            if saver is not None:
                saver.close()
            shutil.rmtree(root, ignore_errors=True)
        figures[name] = entry if saver is None else {"label": saver.label, **entry, **saver.notes}
    for name in ("ours", "titan"):
        if isinstance(figures.get(name), dict) and isinstance(figures.get("none"), dict):
            figures[f"{name}_tokens_x_none"] = round(figures[name]["tokens_per_s"] / figures["none"]["tokens_per_s"], 3)


def train_window(ctx: Context, job: Job, saver, every: int, peak: float | None) -> dict:
    before = None if saver is None else saver.before_optimizer
    for _ in range(2):
        job.step(before)
    if saver is not None:  # back to back (ours: both buffer sets allocated), then drained
        for n in range(saver.warm_saves):
            saver.save(n + 1)
            job.step(before)
            saver.settle()
        saver.drain()
        saver.marks = type(saver.marks)()
    steps, saves = every * WINDOWS, 0
    waited = saver.manager.stats.device_stall_s if isinstance(saver, Ours) else 0.0
    ctx.sync()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        loss = job.step(before)
        if saver is not None and step % every == every // 2:
            saver.save(100 + step)
            saves += 1
    ctx.sync()
    seconds = time.perf_counter() - start
    entry = {"tokens_per_s": round(steps * job.tokens_per_step / seconds, 1),
             "step_ms": round(1e3 * seconds / steps, 2), "saves": saves, "last_loss": round(float(loss), 4)}
    if peak:
        entry["mfu_pct"] = round(100 * job.flops_per_token * entry["tokens_per_s"] / peak, 2)
    if saver is not None:
        drained = time.perf_counter()
        saver.drain()
        entry["drain_after_window_s"] = round(time.perf_counter() - drained, 3)
        if isinstance(saver, Ours):
            entry["copy_ms_total"] = round(saver.copies.take_ms(), 2)
            entry["compute_wait_ms_total"] = round(1e3 * (saver.manager.stats.device_stall_s - waited), 2)
        entry.update({name: round(sum(values) / len(values), 3) for name, values in saver.marks.items() if values})
    return entry


def resume(ctx: Context, figures: dict) -> None:
    from trainer.config import load_config
    from trainer.train import Trainer

    ctx.needs_group()
    base = ctx.work / "resume"
    shutil.rmtree(base, ignore_errors=True)
    cut, end, interval = (2, 4, 2) if ctx.dry else (10, 20, 5)
    sizes = ["--training.seq_len", "32"] if ctx.dry else []

    def run(name: str, stop_at: int | None = None) -> list[float]:
        trainer = Trainer(load_config([
            "--config", "configs/debug.toml", "--training.device", ctx.device_type, "--training.steps", str(end),
            "--checkpoint.enable", "true", "--checkpoint.interval", str(interval), "--metrics.log_freq", "1000",
            "--job.dump_folder", str(base / name), *sizes]))
        try:
            return trainer.fit(stop_at=stop_at)
        finally:
            trainer.close()

    first, resumed, straight = run("resumed", stop_at=cut), run("resumed"), run("straight")
    figures["steps_run"] = [len(first), len(resumed), len(straight)]
    diffs = [abs(a - b) for a, b in zip(resumed, straight[cut:])]
    figures["steps_compared"] = len(diffs)
    figures["max_abs_loss_diff_after_resume"] = max(diffs) if diffs else None
    figures["last_loss"] = resumed[-1] if resumed else None
    shutil.rmtree(base, ignore_errors=True)
    if figures["steps_run"] != [cut, end - cut, end]:
        raise Failed(f"the runs trained {figures['steps_run']} steps, expected {[cut, end - cut, end]}")
    if ctx.device_type == "cpu" and max(diffs) != 0.0:
        raise Failed("on CPU the resumed losses must equal the uninterrupted run's")

"""The stall benchmark's section, and the per-phase figures its goals and JSON share.

The figures of a :class:`~stall_loop.Phase`: its stalls, its adjacent no-save phases and their rate
(the throughput baseline; the machine drifts), the time until each save was durable. :func:`report`
makes the section: one row per method (stall, its two parts, steps/s, CPU time, the next
forward/backward, durable time, memory) and the notes (goals, ours' breakdown and background copy
and write, drift, the peers' parts).
"""

from __future__ import annotations

import argparse

from harness import median  # first: puts this checkout's root on sys.path

from report import goal_line, median_span, provenance, table_head  # noqa: E402
from stall_loop import Phase  # noqa: E402
from stall_methods import METHODS  # noqa: E402

SECTION = "## Checkpoint stall in a training loop (issue 3)"


def gib(n: float) -> str:
    return f"{n / 2**30:+.2f}"


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


def parts_of(p: Phase, leave_out: str = "") -> dict[str, list[float]]:
    """Each named part of the phase's saves (``SaveRecord.parts``, but ``leave_out``): its value per save."""
    parts: dict[str, list[float]] = {}
    for r in p.records:
        for k, v in r.parts.items():
            if k != leave_out:
                parts.setdefault(k, []).append(v)
    return parts


def durable_times(p: Phase) -> list[float]:
    """Seconds from each save's call until its bytes were committed; a synchronous save is committed
    when its call returns."""
    if p.key in ("ours-sync", "torch-save"):
        return [r.in_save for r in p.records]
    return [r.durable for r in p.records if r.durable is not None]


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
        parts = parts_of(ours, leave_out="manager stats.last_stall_s")
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
            parts = parts_of(p)
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

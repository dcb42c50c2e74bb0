#!/usr/bin/env python
"""Trainer throughput: checkpointing cost and framework overhead, in one run (issue 4).

    python benchmarks/bench_trainer.py --quick                      # smoke run: debug, 1 thread, 1 repeat (< 30 s)
    python benchmarks/bench_trainer.py --tiny                       # the tests' run: 10 + 10 steps, 1 thread
    python benchmarks/bench_trainer.py --threads 2 --repeats 3 2 --window 40 10 --breakdown 20 0   # ~5 min
    python benchmarks/bench_trainer.py --threads 1 2 --out benchmarks/RESULTS.md                     # ~25 min

Single process on CPU, ``torch.set_num_threads`` set explicitly (``--threads``; one set of tables
per value). For each model flavor (``--flavors``, default ``debug`` and ``small``) these variants
run, interleaved: every repeat runs each variant once, in an order rotated per repeat, and the
table shows the median over repeats.

trainer                  ``Trainer(load_config(argv))`` with ``--config configs/debug.toml`` and
                         ``--checkpoint.enable false``, in one process: the trainer starts a 1-rank
                         gloo group itself and, with one data-parallel rank, trains the model
                         unwrapped (no FSDP2/DDP), as a user's ``python -m trainer.train`` does.
trainer + ckpt           the same with ``--checkpoint.enable true --checkpoint.interval 10
                         --checkpoint.async_mode double_buffer`` (a save every 10 steps, async).
trainer + sync ckpt      (optional) the same with ``--checkpoint.async_mode sync``.
minimal loop             the same model (``trainer.model.build`` with the same args and seed), the
                         same data (``trainer.data.DataLoader``, same seed, batch, seq_len), AdamW
                         with the trainer's hyper-parameters and LR schedule, and per step:
                         ``model(inputs)``, ``F.cross_entropy``, ``backward``,
                         ``clip_grad_norm_`` (defaults), ``step``, ``scheduler.step``,
                         ``zero_grad(set_to_none=True)``, ``loss.item()``. No process group, no
                         wrapper.

What is timed: the wall time (``time.perf_counter``) at the start of every step, recorded by a thin
wrapper around ``Trainer.train_step`` (the minimal loop records the same mark), plus the time inside
``CheckpointManager.save`` (a wrapper) and ``manager.stats.stall_s`` (``save()`` + the wait for the
snapshot before the next optimizer step). A run has ``--warmup`` steps (excluded), then a
**window** of ``--window`` steps, then one final step. tokens/s = window steps x batch_size x
seq_len / (start of the final step - start of the first window step). The window thus contains
everything the loop does per step: compute, ``save()`` calls, the snapshot wait, the loss
all-reduce, bookkeeping. ``--warmup`` and ``--window`` are multiples of the checkpoint interval
(10), so the window holds exactly ``window / 10`` saves, and the background write of the save at
the end of the warm-up overlaps its start just as the write of its last save overlaps the final
step. The final step (``step == training.steps``) force-saves and ``close()`` waits for all writes;
that tail (the final step plus ``close()``) is reported separately: it is a once-per-run cost, not
steady-state throughput.

Then, per flavor, a per-phase breakdown (``--breakdown`` steps): data, forward + loss, backward,
``clip_grad_norm_``, optimizer step + ``zero_grad``, timed with ``perf_counter`` between phases
(CPU ops are synchronous), for the minimal loop and for the trainer variants without checkpointing
(driving the trainer's own model, optimizer, scheduler and loader, as ``train_step`` does).

Found with this benchmark (fixed in 8878995): with ATen's OpenMP backend, the first parallel op
(e.g. a large ``copy_``) on another long-lived thread gives that thread its own OpenMP team;
libgomp then manages more threads than there are cores and stops letting idle workers spin between
parallel regions, so every later parallel region of the training thread pays a sleep/wake-up for
as long as that thread lives. The manager's snapshot-copier and writer threads did that, and with 2
intra-op threads every training step got slower, also between saves: 0.62x (debug) and 0.85x
(small) tokens/s with a save every 10 steps. The engine's worker threads now start with
``torch.set_num_threads(1)``.

Also found with it (fa87724, 2 threads): FSDP2 over a 1-rank mesh cost +10% (small) to +30%
(debug) time per step against the minimal loop (parameter copy-in/out, optimizer on DTensors),
DDP +2%; so the trainer no longer wraps the model when there is one data-parallel rank.

Checks: the per-step losses of the trainer variants and the minimal loop are compared (same init,
data and hyper-parameters: they should agree to float rounding), as are those of ``trainer``
with and without checkpointing (the save must not change training).

Goals, per flavor and thread count: tokens/s with a save every 10 steps >= 0.98x without; trainer
overhead <= 5% against the minimal loop, i.e. the trainer's tokens/s >= 0.95x the minimal loop's
(both on the medians over repeats).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from harness import (  # first: puts this checkout's root on sys.path
    REPO, Load, argument_parser, git_state, machine_description, median, rotated, work_dir,
)

from report import (  # noqa: E402
    command_line, goal, median_span, metric, provenance, publish, table_head, verdict, write_json,
)
from trainer import data as data_mod  # noqa: E402
from trainer import model as model_mod  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.optim import lr_lambda  # noqa: E402
from trainer.train import Trainer  # noqa: E402

BENCH_NAME = "trainer"
SECTION = "## Trainer throughput (issue 4)"
BASE_CONFIG = "configs/debug.toml"
INTERVAL = 10
GOAL_CKPT_RATIO = 0.98  # tokens/s with a save every INTERVAL steps >= 0.98x without
GOAL_OVERHEAD = 0.05  # trainer overhead <= 5%: tokens/s >= (1 - 0.05)x the minimal loop's
# --quick: a smoke run (< 30 s on 2 idle cores): debug only, 1 thread, 1 repeat, a 10-step window (one save), no
# warm-up runs. One intra-op thread: two threads on a box whose cores other jobs hold spin in OpenMP's barriers,
# and the run then went past run.py's 300 s limit for a quick benchmark (issue 36).
QUICK = {"flavors": ["debug"], "threads": [1], "repeats": [1, 1], "warmup": [10, 10], "window": [10, 10],
         "breakdown": [0, 0], "no_warmup": True}
# --tiny: the tests' smoke run of every part (the breakdown included): debug, 1 thread, 10 + 10 steps
TINY = {"flavors": ["debug"], "threads": [1], "repeats": [1, 1], "warmup": [10, 10], "window": [10, 10],
        "breakdown": [3, 0], "no_warmup": True}

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")


# ---------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------
@dataclass
class Variant:
    key: str
    name: str
    overrides: list[str] | None  # trainer CLI overrides; None: the minimal loop
    window_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)  # inside train_step, window steps
    stall_s: list[float] = field(default_factory=list)  # manager.stats.stall_s over the window
    save_s: list[float] = field(default_factory=list)  # inside manager.save() over the window
    tail_s: list[float] = field(default_factory=list)  # final step + close()
    close_s: list[float] = field(default_factory=list)  # close() alone
    saves: list[int] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)


CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", str(INTERVAL),
        "--checkpoint.async_mode", "double_buffer"]
NO_CKPT = ["--checkpoint.enable", "false"]

ALL_VARIANTS = {
    "trainer": ("trainer, no ckpt", NO_CKPT),
    "trainer_ckpt": (f"trainer + async ckpt every {INTERVAL}", CKPT),
    "minimal": ("minimal loop", None),
    "trainer_sync_ckpt": (f"trainer + sync ckpt every {INTERVAL}",
                          CKPT[:-1] + ["sync"]),
}
LABELS = {  # the short system labels of the JSON metrics (plot legends)
    "trainer": "trainer",
    "trainer_ckpt": f"trainer + async checkpoint every {INTERVAL}",
    "minimal": "minimal loop",
    "trainer_sync_ckpt": f"trainer + sync checkpoint every {INTERVAL}",
}
DEFAULT_VARIANTS = ["trainer", "trainer_ckpt", "minimal"]


def trainer_argv(flavor: str, steps: int, dump: Path, overrides: list[str]) -> list[str]:
    return ["--config", BASE_CONFIG, "--model.flavor", flavor, "--training.steps", str(steps),
            "--training.device", "cpu", "--metrics.log_freq", "1000000000", "--job.dump_folder", str(dump),
            *overrides]


def run_trainer(argv: list[str], warmup: int, window: int) -> dict:
    """One trainer run; marks[i] = wall time at the start of step i + 1."""
    cfg = load_config(argv)
    os.makedirs(cfg.job.dump_folder, exist_ok=True)
    tr = Trainer(cfg)
    marks: list[float] = []  # wall time at the start of each step
    ends: list[float] = []  # ... and when its train_step returned
    stalls: list[float] = []  # manager.stats.stall_s at the start of each step
    saves_in: list[float] = []  # cumulative seconds inside manager.save() at the start of each step
    in_save = [0.0]
    inner_step = tr.train_step

    def marked_step():
        marks.append(time.perf_counter())
        stalls.append(tr.manager.stats.stall_s if tr.manager is not None else 0.0)
        saves_in.append(in_save[0])
        out = inner_step()
        ends.append(time.perf_counter())
        return out

    tr.train_step = marked_step
    if tr.manager is not None:
        inner_save = tr.manager.save

        def timed_save(*a, **kw):
            start = time.perf_counter()
            try:
                return inner_save(*a, **kw)
            finally:
                in_save[0] += time.perf_counter() - start

        tr.manager.save = timed_save
    gc.collect()
    try:
        losses = tr.fit()
        fit_end = time.perf_counter()
    finally:
        close_start = time.perf_counter()
        tr.close()
        close_end = time.perf_counter()
    a, b = warmup, warmup + window  # window: steps a+1 .. b; step b+1 is the final one
    saves = tr.manager.stats.saves if tr.manager is not None else 0
    return {
        "window_s": marks[b] - marks[a],
        "compute_s": sum(ends[i] - marks[i] for i in range(a, b)),
        "stall_s": stalls[b] - stalls[a],
        "save_s": saves_in[b] - saves_in[a],
        "tail_s": close_end - marks[b],
        "close_s": close_end - close_start,
        "final_step_s": fit_end - marks[b],
        "saves": saves,
        "losses": losses,
    }


def build_minimal(flavor: str, steps: int, tokens):
    """Model, AdamW, LR schedule, loader and config of the hand-written loop: the trainer's model
    args, seed, data and hyper-parameters, no process group, no wrapper."""
    cfg = load_config(trainer_argv(flavor, steps, Path("unused"), NO_CKPT))
    t = cfg.training
    torch.manual_seed(cfg.job.seed)
    args = model_mod.model_args(
        cfg.model.flavor, vocab_size=data_mod.ByteTokenizer.vocab_size,
        max_seq_len=max(t.seq_len, model_mod.FLAVORS[cfg.model.flavor.lower()].max_seq_len))
    model = model_mod.build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.warmup_steps, t.steps, t.min_lr_ratio))
    loader = data_mod.DataLoader(tokens, t.seq_len, t.batch_size, 0, 1, cfg.job.seed)
    return model, opt, sched, loader, t


def run_minimal(flavor: str, steps: int, warmup: int, window: int, tokens) -> dict:
    """The hand-written loop with the trainer's model, data and hyper-parameters."""
    model, opt, sched, loader, t = build_minimal(flavor, steps, tokens)
    marks: list[float] = []
    losses: list[float] = []
    gc.collect()
    for _ in range(steps):
        marks.append(time.perf_counter())
        inputs, labels = loader.next_batch()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    end = time.perf_counter()
    a, b = warmup, warmup + window
    return {"window_s": marks[b] - marks[a], "compute_s": marks[b] - marks[a], "stall_s": 0.0, "save_s": 0.0,
            "tail_s": end - marks[b], "close_s": 0.0, "final_step_s": end - marks[b], "saves": 0,
            "losses": losses}


PHASES = ("data", "forward + loss", "backward", "clip_grad_norm_", "optimizer step + zero_grad")


def phase_breakdown(flavor: str, key: str, steps: int, skip: int, tokens, base: Path) -> dict[str, float]:
    """Median seconds per phase of one step (over ``steps - skip`` steps), for the minimal loop or
    for a trainer variant (its own model/optimizer/loader driven by the same code as
    ``Trainer.train_step`` with accumulation 1, timed between phases; CPU ops are synchronous)."""
    tr = None
    if ALL_VARIANTS[key][1] is None:
        model, opt, sched, loader, t = build_minimal(flavor, steps, tokens)
        foreach = None
    else:
        dump = Path(tempfile.mkdtemp(prefix=f"breakdown-{key}-", dir=base))
        tr = Trainer(load_config(trainer_argv(flavor, steps, dump, ALL_VARIANTS[key][1])))
        model, opt, sched, loader, t = tr.model, tr.optimizer, tr.scheduler, tr.loader, tr.cfg.training
        foreach = True
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    try:
        for i in range(steps):
            marks = [time.perf_counter()]
            inputs, labels = loader.next_batch()
            marks.append(time.perf_counter())
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            marks.append(time.perf_counter())
            loss.backward()
            marks.append(time.perf_counter())
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm, foreach=foreach)
            marks.append(time.perf_counter())
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
            marks.append(time.perf_counter())
            if i >= skip:
                for name, x, y in zip(PHASES, marks, marks[1:]):
                    times[name].append(y - x)
    finally:
        if tr is not None:
            tr.close()
            shutil.rmtree(dump, ignore_errors=True)
    return {name: statistics.median(xs) for name, xs in times.items()}


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def flavor_params(flavor: str) -> int:
    args = model_mod.model_args(flavor, vocab_size=data_mod.ByteTokenizer.vocab_size)
    with torch.device("meta"):
        return model_mod.num_params(model_mod.Transformer(args))


def run_flavor(flavor: str, fargs: dict, variants: list[Variant], repeats: int, base: Path, tokens,
               untimed_warmup: bool, tag: str) -> None:
    warmup, window = fargs["warmup"], fargs["window"]
    steps = warmup + window + 1
    work = Path(tempfile.mkdtemp(prefix=f"{flavor}-", dir=base))

    def one(v: Variant, run: str) -> dict:
        if v.overrides is None:
            return run_minimal(flavor, steps, warmup, window, tokens)
        dump = work / f"{v.key}-{run}"
        try:
            return run_trainer(trainer_argv(flavor, steps, dump, v.overrides), warmup, window)
        finally:
            shutil.rmtree(dump, ignore_errors=True)

    try:
        if untimed_warmup:  # first-call costs of every code path (process group, FSDP, staging buffers)
            for v in variants:
                t0 = time.perf_counter()
                one(v, "warmup")
                print(f"[{tag}] untimed warm-up {v.name}: {time.perf_counter() - t0:.1f}s", flush=True)
        tokens_per_window = window * fargs["batch"] * fargs["seq_len"]
        for rep in range(repeats):
            for v in rotated(variants, rep):
                r = one(v, f"r{rep}")
                for name in ("window_s", "compute_s", "stall_s", "save_s", "tail_s", "close_s", "saves", "losses"):
                    getattr(v, name).append(r[name])
                print(f"[{tag} {rep + 1}/{repeats}] {v.name:40s} {tokens_per_window / r['window_s']:9.0f} tok/s"
                      f"  window {r['window_s']:7.2f}s  in train_step {r['compute_s']:7.2f}s"
                      f"  save() {r['save_s'] * 1e3:7.1f}ms  stall {r['stall_s'] * 1e3:7.1f}ms"
                      f"  final step+close {r['tail_s']:6.2f}s  load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def max_loss_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def tokens_per_s(fargs: dict, v: Variant) -> list[float]:
    """tokens/s of each repeat's window."""
    return [fargs["window"] * fargs["batch"] * fargs["seq_len"] / w for w in v.window_s]


def where(fargs: dict) -> str:
    return f"{fargs['flavor']}, {fargs['threads']} thread{'s' if fargs['threads'] > 1 else ''}"


def flavor_goals(fargs: dict, variants: list[Variant]) -> dict[str, dict]:
    """The two goals of one table, as measured on the medians over repeats (tokens/s = tokens / window
    time, so a ratio of tokens/s is the inverse ratio of the median window times)."""
    by = {v.key: v for v in variants}
    out = {}
    if "trainer" in by and "trainer_ckpt" in by:
        base, ck = by["trainer"], by["trainer_ckpt"]
        per_rep = [a / b for a, b in zip(base.window_s, ck.window_s)]
        out["ckpt"] = goal(
            f"tokens/s with a save every {INTERVAL} steps ≥ {GOAL_CKPT_RATIO}× without ({where(fargs)})",
            median(base.window_s) / median(ck.window_s), GOAL_CKPT_RATIO, ">=",
            f"medians over {len(per_rep)} repeats: {median(tokens_per_s(fargs, ck)):,.0f} vs "
            f"{median(tokens_per_s(fargs, base)):,.0f} tokens/s; paired per repeat {min(per_rep):.3f}–{max(per_rep):.3f}×")
    if "trainer" in by and "minimal" in by:
        t, m = by["trainer"], by["minimal"]
        per_rep = [a / b for a, b in zip(m.window_s, t.window_s)]
        out["overhead"] = goal(
            f"trainer overhead ≤ {GOAL_OVERHEAD:.0%}: tokens/s ≥ {1 - GOAL_OVERHEAD:.2f}× the minimal loop ({where(fargs)})",
            median(m.window_s) / median(t.window_s), 1 - GOAL_OVERHEAD, ">=",
            f"medians over {len(per_rep)} repeats: {median(tokens_per_s(fargs, t)):,.0f} vs "
            f"{median(tokens_per_s(fargs, m)):,.0f} tokens/s; paired per repeat {min(per_rep):.3f}–{max(per_rep):.3f}×")
    return out


def flavor_metrics(fargs: dict, variants: list[Variant]) -> list[dict]:
    """Per variant: tokens/s per repeat; for the checkpointing ones also the stall per save per repeat:
    the time inside ``save()`` (our wrapper) + the snapshot wait before the next optimizer step
    (``manager.stats.stall_s`` minus ``save()``; that difference can come out slightly negative, the
    wrapper timing a little more than the manager's own clock, and then counts as 0)."""
    tags = {"flavor": fargs["flavor"], "threads": fargs["threads"]}
    out = []
    for v in variants:
        out.append(metric(LABELS[v.key], "tokens_per_s", "tokens/s", tokens_per_s(fargs, v), **tags))
        if "ckpt" in v.key:
            saves = fargs["window"] // INTERVAL
            out.append(metric(LABELS[v.key], "stall_per_save_s", "s",
                              [max(st, sv) / saves for st, sv in zip(v.stall_s, v.save_s)], **tags))
    return out


def flavor_report(title: str, fargs: dict, variants: list[Variant],
                  breakdown: dict[str, dict[str, float]] | None) -> list[str]:
    by = {v.key: v for v in variants}
    window = fargs["window"]
    tokens = window * fargs["batch"] * fargs["seq_len"]
    lines = [
        f"### {title}",
        "",
        f"{fargs['params'] / 1e6:.2f}M parameters (fp32 weights + AdamW state: {fargs['params'] * 12 / 1e6:.0f} MB "
        f"per checkpoint); batch {fargs['batch']} x seq_len {fargs['seq_len']} = {fargs['batch'] * fargs['seq_len']} "
        f"tokens/step; per run {fargs['warmup']} warm-up steps, a window of {window} steps, 1 final step; "
        f"median of {fargs['repeats']} repeats.",
        "",
        *table_head(["Variant", "tokens/s", "× minimal", "× trainer no ckpt", "window s (min–max)", "ms/step",
                     "train_step ms/step (excl. snapshot wait)", "save() ms/save", "snapshot wait ms/save",
                     "other ms/step", "final step + close s (close)"], "l" + "r" * 10),
    ]
    for v in variants:
        w, c = median(v.window_s), median(v.compute_s)
        nsave = window // INTERVAL if "ckpt" in v.key else 0
        save = median(v.save_s)
        wait = median([st - sv for st, sv in zip(v.stall_s, v.save_s)])
        rel_min = f"{median(by['minimal'].window_s) / w:.3f}" if "minimal" in by else "–"
        rel_trainer = f"{median(by['trainer'].window_s) / w:.3f}" if "trainer" in by else "–"
        lines.append(
            f"| {v.name} | {tokens / w:,.0f} | {rel_min} | {rel_trainer} "
            f"| {median_span(v.window_s, 2)} | {1e3 * w / window:.1f} "
            f"| {1e3 * (c - wait) / window:.1f} | {f'{1e3 * save / nsave:.1f}' if nsave else '–'} "
            f"| {f'{1e3 * wait / nsave:.1f}' if nsave else '–'} | {1e3 * (w - c - save) / window:.2f} "
            f"| {median(v.tail_s):.2f} ({median(v.close_s):.2f}) |")
    notes = []
    goals = flavor_goals(fargs, variants)
    for base_key, ck_key, label in (
        ("trainer", "trainer_ckpt", f"Goal tokens/s with a save every {INTERVAL} steps ≥ {GOAL_CKPT_RATIO}× without"),
        ("trainer", "trainer_sync_ckpt", "The same ratio with synchronous saves (for comparison)"),
    ):
        if base_key not in by or ck_key not in by:
            continue
        base, ck = by[base_key], by[ck_key]
        per_rep = [a / b for a, b in zip(base.window_s, ck.window_s)]
        ratio = median(base.window_s) / median(ck.window_s)  # = goals["ckpt"]["measured"] for trainer_ckpt
        extra = median(ck.window_s) - median(base.window_s)
        save, stall = median(ck.save_s), median(ck.stall_s)
        slowdown = (median(ck.compute_s) - (stall - save)) - median(base.compute_s)
        notes.append(
            f"- {label}: {verdict(ratio >= GOAL_CKPT_RATIO)} ({ratio:.3f}× on medians; per repeat "
            f"{', '.join(f'{x:.3f}' for x in per_rep)}; best repeat vs best repeat "
            f"{min(base.window_s) / min(ck.window_s):.3f}×). The window took {extra * 1e3:+.0f} ms longer "
            f"({window // INTERVAL} save{'s' if window // INTERVAL > 1 else ''}): inside `save()` {save * 1e3:.0f} ms, snapshot wait before the optimizer "
            f"step {(stall - save) * 1e3:.0f} ms, the rest of the steps {slowdown * 1e3:+.0f} ms. Once per run, the "
            f"final forced save + `close()` take {median(ck.tail_s):.2f} s vs {median(base.tail_s):.2f} s for the final "
            f"step without checkpointing (not in the ratio).")
        d = max_loss_diff(base.losses, ck.losses)
        notes.append(f"  Losses with and without checkpointing: max |difference| {d:.2g} over all steps and repeats.")
    if "minimal" in by and "trainer" in by:
        m, t = by["minimal"], by["trainer"]
        g = goals["overhead"]
        over = median(t.window_s) / median(m.window_s) - 1
        best = min(t.window_s) / min(m.window_s) - 1
        notes.append(f"- Goal trainer overhead ≤ {GOAL_OVERHEAD:.0%} vs the minimal loop (tokens/s ≥ "
                     f"{1 - GOAL_OVERHEAD:.2f}× the minimal loop's): {verdict(g['met'])} ({g['measured']:.3f}× tokens/s, "
                     f"{over:+.1%} time per step on medians; best repeat vs best repeat {best:+.1%}).")
        notes.append(f"- Losses of the trainer and the minimal loop: max |difference| {max_loss_diff(t.losses, m.losses):.2g} "
                     "(same init, data, hyper-parameters).")
    out = lines + [""] + notes + [""]
    if breakdown:
        names = {k: ALL_VARIANTS[k][0] for k in breakdown}
        out += [
            f"Where the time goes: ms per phase of one step, median over {fargs['breakdown_steps']} steps after "
            f"{fargs['breakdown_skip']} skipped, same phases timed in the same way for each (the trainer rows drive "
            f"the trainer's own model, optimizer, scheduler and loader; no checkpointing):",
            "",
            *table_head(["Variant", *PHASES, "total"], "l" + "r" * (len(PHASES) + 1)),
        ]
        for key, phases in breakdown.items():
            out.append(f"| {names[key]} | " + " | ".join(f"{1e3 * phases[p]:.1f}" for p in PHASES)
                       + f" | {1e3 * sum(phases.values()):.1f} |")
        out.append("")
    return out


def report(results: list[tuple[str, dict, list[Variant], dict | None]], info: dict, args, command: str) -> str:
    body = [
        SECTION,
        "",
        f"Single process on CPU, torch intra-op threads set explicitly per table (`torch.set_num_threads`). Trainer "
        f"runs are `Trainer(load_config(argv))` with `--config {BASE_CONFIG} --model.flavor F --training.steps N "
        f"--training.device cpu --metrics.log_freq 1000000000 --job.dump_folder <tmp>` plus the variant's overrides "
        f"(one data-parallel rank: the trainer trains the model unwrapped, in the 1-rank gloo group it starts "
        f"itself; Python's automatic garbage collection is off, generations 0-1 collected every 50 steps, "
        f"`training.gc_freq`); ckpt = `{' '.join(CKPT)}` (keep 3, local "
        f"disk, full checkpoints). The minimal loop: the same model args and seed, the same loader, AdamW (same "
        f"hyper-parameters, same LR schedule), `model(inputs)`, `cross_entropy`, `backward`, `clip_grad_norm_`, "
        f"`step`, `zero_grad`, `loss.item()`; no process group, no wrapper. Variants interleaved, order rotated per "
        f"repeat; medians. tokens/s over a window of steady-state steps that starts after the warm-up steps and ends "
        f"at the start of the final step: it holds window/{INTERVAL} saves (their `save()` calls and the snapshot "
        f"waits before the next optimizer step) and overlaps as many background writes; the final step (forced save) "
        f"+ `close()` (waits for the writes) is reported separately. 'train_step' = forward/backward/clip/optimizer; "
        f"'other' = loss all-reduce, bookkeeping and the benchmark's marks. "
        f"{'An untimed warm-up run of every variant came first (once, before the first table).' if not args.no_warmup else ''}",
        "",
    ]
    for title, fargs, variants, breakdown in results:
        body += flavor_report(title, fargs, variants, breakdown)
    body += [
        *provenance(info["machine"], command, load=info["contention"], extra=[f"Code: {info['git']}"]),
    ]
    return "\n".join(body)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--flavors", nargs="+", default=["debug", "small"], choices=["debug", "small"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1],
                        help="torch.set_num_threads values, one set of tables each (default 1: the other core "
                             "is left to the checkpoint writer and the OS)")
    parser.add_argument("--repeats", type=int, nargs=2, default=[5, 3], metavar=("DEBUG", "SMALL"),
                        help="repeats per flavor (default 5 3)")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(ALL_VARIANTS))
    parser.add_argument("--warmup", type=int, nargs=2, default=[10, 10], metavar=("DEBUG", "SMALL"),
                        help="warm-up steps excluded from the window, per flavor (multiples of 10; default 10 10)")
    parser.add_argument("--window", type=int, nargs=2, default=[60, 20], metavar=("DEBUG", "SMALL"),
                        help="timed steps per run, per flavor (multiples of 10; default 60 20)")
    parser.add_argument("--breakdown", type=int, nargs=2, default=[30, 8], metavar=("DEBUG", "SMALL"),
                        help="steps of the per-phase breakdown per flavor (0: skip it; default 30 8)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of every variant")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run (< 30 s on 2 idle cores): debug only, 1 thread, 1 repeat, 10 warm-up "
                             "steps, a 10-step window, no breakdown, no untimed warm-up runs")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' smoke run: debug, 1 thread, 10 warm-up + 10 window steps, a 3-step breakdown")
    args = parser.parse_args(argv)
    for k, v in (TINY if args.tiny else QUICK if args.quick else {}).items():
        setattr(args, k, v)
    for n in (*args.warmup, *args.window):
        if n < INTERVAL or n % INTERVAL:
            parser.error(f"--warmup and --window must be positive multiples of {INTERVAL}")
    os.chdir(REPO)  # BASE_CONFIG and the shipped corpus are relative to the repository

    command = command_line("bench_trainer.py", argv)
    tokens = data_mod.TokenStream(data_mod.load_documents("shipped"), data_mod.ByteTokenizer()).tokens
    cfg = load_config(["--config", BASE_CONFIG])
    results = []
    info: dict = {}
    load = Load(processes=True)
    with work_dir(args.dir, "trainer-") as work:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for i, flavor in enumerate(["debug", "small"]):
                if flavor not in args.flavors:
                    continue
                tag = f"{flavor}, {threads} thread{'s' if threads > 1 else ''}"
                fargs = {"flavor": flavor, "threads": threads, "warmup": args.warmup[i], "window": args.window[i],
                         "batch": cfg.training.batch_size, "seq_len": cfg.training.seq_len,
                         "params": flavor_params(flavor), "repeats": args.repeats[i]}
                variants = [Variant(k, ALL_VARIANTS[k][0], ALL_VARIANTS[k][1]) for k in args.variants]
                run_flavor(flavor, fargs, variants, args.repeats[i], work, tokens,
                           not args.no_warmup and not results, tag)
                breakdown = None
                if args.breakdown[i]:
                    skip = min(5, args.breakdown[i] // 3)
                    fargs["breakdown_steps"], fargs["breakdown_skip"] = args.breakdown[i] - skip, skip
                    breakdown = {}
                    for key in [k for k in args.variants if "ckpt" not in k]:
                        breakdown[key] = phase_breakdown(flavor, key, args.breakdown[i], skip, tokens, work)
                        print(f"[{tag}] breakdown {ALL_VARIANTS[key][0]}: "
                              + ", ".join(f"{k} {1e3 * v:.1f}ms" for k, v in breakdown[key].items()), flush=True)
                results.append((tag, fargs, variants, breakdown))
    load.stop()
    info["contention"] = (load.describe("during the run", note=" (this benchmark itself keeps 1-2 busy)")
                          + f"; the run took {load.elapsed / 60:.1f} min")
    info["machine"] = machine_description(
        work, cpu_extra=f"; torch intra-op threads {', '.join(map(str, args.threads))} (one set of tables each), "
                        f"inter-op {torch.get_num_interop_threads()}")
    info["git"] = git_state()
    section = report(results, info, args, command)
    publish(section, args.out)
    metrics = [m for _, fargs, variants, _ in results for m in flavor_metrics(fargs, variants)]
    goals = [g for _, fargs, variants, _ in results for g in flavor_goals(fargs, variants).values()]
    params = {"flavors": args.flavors, "threads": args.threads, "repeats": dict(zip(("debug", "small"), args.repeats)),
              "warmup": dict(zip(("debug", "small"), args.warmup)), "window": dict(zip(("debug", "small"), args.window)),
              "variants": args.variants, "untimed_warmup": not args.no_warmup, "quick": args.quick,
              "interval": INTERVAL, "batch": cfg.training.batch_size, "seq_len": cfg.training.seq_len}
    write_json(args.json, BENCH_NAME, section, command, metrics=metrics, goals=goals, params=params)
    return 0


if __name__ == "__main__":
    sys.exit(main())

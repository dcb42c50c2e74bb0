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

import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from harness import (  # first: puts this checkout's root on sys.path
    REPO, Load, add_modes, apply_mode, argument_parser, git_state, machine_description, rotated, work_dir,
)

from report import command_line, publish, write_json  # noqa: E402
from trainer import data as data_mod  # noqa: E402
from trainer import exits  # noqa: E402
from trainer import model as model_mod  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer_report import flavor_goals, flavor_metrics, report  # noqa: E402
from trainer_runs import (  # noqa: E402
    BASE_CONFIG, CKPT, INTERVAL, NO_CKPT, Variant, phase_breakdown, run_minimal, run_trainer, trainer_argv,
)

BENCH_NAME = "trainer"
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


VARIANTS = {  # key: (row in the tables, system in the JSON metrics, trainer overrides or None: the minimal loop)
    "trainer": ("trainer, no ckpt", "trainer", NO_CKPT),
    "trainer_ckpt": (f"trainer + async ckpt every {INTERVAL}", f"trainer + async checkpoint every {INTERVAL}", CKPT),
    "minimal": ("minimal loop", "minimal loop", None),
    "trainer_sync_ckpt": (f"trainer + sync ckpt every {INTERVAL}", f"trainer + sync checkpoint every {INTERVAL}",
                          CKPT[:-1] + ["sync"]),
}
FULL = {"flavors": ["debug", "small"], "threads": [1], "repeats": [5, 3], "warmup": [10, 10], "window": [60, 20],
        "breakdown": [30, 8], "no_warmup": False, "variants": ["trainer", "trainer_ckpt", "minimal"]}


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------
def flavor_params(flavor: str) -> int:
    args = model_mod.model_args(flavor, vocab_size=data_mod.ByteTokenizer.vocab_size)
    with torch.device("meta"):
        return model_mod.num_params(model_mod.Transformer(args))


def run_flavor(flavor: str, fargs: dict, variants: list[Variant], repeats: int, base: Path,
               untimed_warmup: bool, tag: str) -> None:
    warmup, window = fargs["warmup"], fargs["window"]
    steps = warmup + window + 1
    work = Path(tempfile.mkdtemp(prefix=f"{flavor}-", dir=base))

    def one(v: Variant, run: str) -> dict:
        if v.overrides is None:
            return run_minimal(flavor, steps, warmup, window)
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
                v.add(r)
                print(f"[{tag} {rep + 1}/{repeats}] {v.name:40s} {tokens_per_window / r['window_s']:9.0f} tok/s"
                      f"  window {r['window_s']:7.2f}s  in train_step {r['compute_s']:7.2f}s"
                      f"  save() {r['save_s'] * 1e3:7.1f}ms  stall {r['stall_s'] * 1e3:7.1f}ms"
                      f"  final step+close {r['tail_s']:6.2f}s  load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--flavors", nargs="+", choices=["debug", "small"],
                        help=f"model flavors (default {' '.join(FULL['flavors'])})")
    parser.add_argument("--threads", type=int, nargs="+",
                        help="torch.set_num_threads values, one set of tables each (default 1: the other core "
                             "is left to the checkpoint writer and the OS)")
    parser.add_argument("--repeats", type=int, nargs=2, metavar=("DEBUG", "SMALL"),
                        help="repeats per flavor (default 5 3)")
    parser.add_argument("--variants", nargs="+", default=["trainer", "trainer_ckpt", "minimal"], choices=list(VARIANTS))
    parser.add_argument("--warmup", type=int, nargs=2, metavar=("DEBUG", "SMALL"),
                        help="warm-up steps excluded from the window, per flavor (multiples of 10; default 10 10)")
    parser.add_argument("--window", type=int, nargs=2, metavar=("DEBUG", "SMALL"),
                        help="timed steps per run, per flavor (multiples of 10; default 60 20)")
    parser.add_argument("--breakdown", type=int, nargs=2, metavar=("DEBUG", "SMALL"),
                        help="steps of the per-phase breakdown per flavor (0: skip it; default 30 8)")
    parser.add_argument("--no-warmup", action="store_true", default=None,
                        help="skip the untimed warm-up run of every variant")
    add_modes(parser, TINY, QUICK, quick_note=" (< 30 s on 2 idle cores)")
    args = parser.parse_args(argv)
    apply_mode(args, TINY, QUICK, FULL)
    for n in (*args.warmup, *args.window):
        if n < INTERVAL or n % INTERVAL:
            parser.error(f"--warmup and --window must be positive multiples of {INTERVAL}")
    os.chdir(REPO)  # BASE_CONFIG and the shipped corpus are relative to the repository
    try:
        return measure(args, command_line("bench_trainer.py", argv))
    finally:  # the runs' 1-rank gloo groups go (their threads joined) before the interpreter does
        exits.release_process_groups()


def measure(args, command: str) -> int:
    """Every table: per thread count and flavor, the variants' repeats and the breakdown; then the report."""
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
                variants = [Variant(k, *VARIANTS[k]) for k in args.variants]
                run_flavor(flavor, fargs, variants, args.repeats[i], work, not args.no_warmup and not results, tag)
                breakdown = None
                if args.breakdown[i]:
                    skip = min(5, args.breakdown[i] // 3)
                    fargs["breakdown_steps"], fargs["breakdown_skip"] = args.breakdown[i] - skip, skip
                    breakdown = {}
                    for v in variants:
                        if "ckpt" in v.key:
                            continue
                        breakdown[v.name] = phase_breakdown(flavor, v.overrides, args.breakdown[i], skip, work)
                        print(f"[{tag}] breakdown {v.name}: "
                              + ", ".join(f"{k} {1e3 * x:.1f}ms" for k, x in breakdown[v.name].items()), flush=True)
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

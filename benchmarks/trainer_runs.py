"""One timed run of ``bench_trainer.py``: the trainer in-process, or the minimal loop, and the
per-phase breakdown of a step.

* :func:`run_trainer`: ``Trainer(load_config(argv))``, ``fit()``, ``close()``, with a thin wrapper
  around ``Trainer.train_step`` that records the wall time at the start of every step (and when its
  ``train_step`` returned, and ``manager.stats.stall_s`` then), and one around
  ``CheckpointManager.save`` that sums the time inside it.
* :func:`run_minimal`: the minimal loop (``minimal_loop``) of the same config, the same marks.
* :func:`phase_breakdown`: median seconds per phase of a step (``minimal_loop.PHASES``), for the
  minimal loop or for a trainer's own model, optimizer, scheduler and loader.

A run is ``warmup`` steps, a window of ``window`` steps, one final step; its record: ``window_s``
(start of the first window step to the start of the final one), ``compute_s`` (inside
``train_step`` over the window), ``stall_s`` (the manager's counter over the window), ``save_s``
(inside ``save()`` over the window), ``tail_s`` (final step + ``close()``), ``close_s``,
``final_step_s``, ``saves`` and the per-step ``losses``.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness  # noqa: F401  first: puts this checkout's root on sys.path

import minimal_loop  # noqa: E402
from minimal_loop import PHASES, MinimalLoop, phase_marks  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.train import Trainer  # noqa: E402

BASE_CONFIG = "configs/debug.toml"
INTERVAL = 10  # steps between saves of the checkpointing variants
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", str(INTERVAL),
        "--checkpoint.async_mode", "double_buffer"]
NO_CKPT = ["--checkpoint.enable", "false"]
RECORD = ("window_s", "compute_s", "stall_s", "save_s", "tail_s", "close_s", "saves", "losses")


@dataclass
class Variant:
    """One row of the tables: what it runs and, per repeat, the fields of its runs' records."""
    key: str
    name: str  # its row in the tables
    label: str  # its system in the JSON metrics (plot legends)
    overrides: list[str] | None  # trainer CLI overrides; None: the minimal loop
    window_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)  # inside train_step, window steps
    stall_s: list[float] = field(default_factory=list)  # manager.stats.stall_s over the window
    save_s: list[float] = field(default_factory=list)  # inside manager.save() over the window
    tail_s: list[float] = field(default_factory=list)  # final step + close()
    close_s: list[float] = field(default_factory=list)  # close() alone
    saves: list[int] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)

    def add(self, record: dict) -> None:
        for name in RECORD:
            getattr(self, name).append(record[name])


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


def build_minimal(flavor: str, steps: int) -> MinimalLoop:
    """The minimal loop of the trainer config a run of ``flavor`` over ``steps`` steps has."""
    return minimal_loop.build(load_config(trainer_argv(flavor, steps, Path("unused"), NO_CKPT)))


def run_minimal(flavor: str, steps: int, warmup: int, window: int) -> dict:
    """The hand-written loop with the trainer's model, data and hyper-parameters."""
    loop = build_minimal(flavor, steps)
    marks: list[float] = []
    losses: list[float] = []
    gc.collect()
    for _ in range(steps):
        marks.append(time.perf_counter())
        losses.append(loop.step())
    end = time.perf_counter()
    a, b = warmup, warmup + window
    return {"window_s": marks[b] - marks[a], "compute_s": marks[b] - marks[a], "stall_s": 0.0, "save_s": 0.0,
            "tail_s": end - marks[b], "close_s": 0.0, "final_step_s": end - marks[b], "saves": 0,
            "losses": losses}


def phase_breakdown(flavor: str, overrides: list[str] | None, steps: int, skip: int, base: Path) -> dict[str, float]:
    """Median seconds per phase of one step (over ``steps - skip`` steps), for the minimal loop
    (``overrides`` None) or for a trainer with ``overrides`` (its own model/optimizer/loader driven by
    the same code as ``Trainer.train_step`` with accumulation 1, timed between phases)."""
    tr = None
    if overrides is None:
        loop = build_minimal(flavor, steps)
    else:
        dump = Path(tempfile.mkdtemp(prefix="breakdown-", dir=base))
        tr = Trainer(load_config(trainer_argv(flavor, steps, dump, overrides)))
        loop = MinimalLoop(tr.model, tr.optimizer, tr.scheduler, tr.loader, tr.cfg.training.max_norm, foreach=True)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    try:
        for i in range(steps):
            marks: list[float] = []
            loop.step(phase_marks(marks))
            if i >= skip:
                for name, x, y in zip(PHASES, marks, marks[1:]):
                    times[name].append(y - x)
    finally:
        if tr is not None:
            tr.close()
            shutil.rmtree(dump, ignore_errors=True)
    return {name: statistics.median(xs) for name, xs in times.items()}

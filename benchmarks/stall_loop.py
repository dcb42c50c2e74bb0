"""The stall benchmark's training loop: a CPU training job, run in phases with a checkpoint method.

:class:`Trainer` is the job: ``Linear(hidden, hidden)`` layers sized so that weights + AdamW state
come to about ``gib`` GiB, one real forward/backward/AdamW step on random batches. A :class:`Method`
is one way to checkpoint it (``stall_methods``): ``save`` runs on the training thread;
``before_step`` / ``after_step`` run right before / after ``optimizer.step()`` (time spent in
``before_step``, or read from the engine in ``after_step``, is the wait before the next step).
:func:`run_phase` runs one phase: an untimed warm-up save (drained), then ``steps`` steps with a save
after steps 1, 1 + every, ...; it records per save a :class:`SaveRecord` (stall = in the save call +
the wait before the next optimizer step; durable time where the method tells) and per phase the
step times, steps/s, CPU time and memory (:class:`Phase`).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness import median, settle  # first: puts this checkout's root on sys.path

from probes import peak_rss, reset_peak, rss  # noqa: E402
from states import model_and_optimizer_tensors  # noqa: E402

HIDDEN = 2048


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

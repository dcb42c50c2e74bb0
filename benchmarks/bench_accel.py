#!/usr/bin/env python
"""Accelerator: staging, checkpoint stall and tokens/s on one CUDA GPU (CPU fallback for a dry run).

    python benchmarks/bench_accel.py                              # CUDA: ~1B llama, under 8 minutes
    python benchmarks/bench_accel.py --cpu-only --quick           # CPU: debug llama, proves the script

One process, one rank: a 1-rank process group initialised through ``env://`` (MASTER_ADDR=127.0.0.1
and a free MASTER_PORT are set when absent, so no torchrun is needed) with backend
``cpu:gloo,cuda:nccl`` on CUDA (NCCL for the device; DCP's ``async_save`` needs the gloo half for its
CPU collectives) and ``gloo`` on CPU. ckpt's manager and DCP run under it. Needs torch and this
checkout; ``ckpt`` also imports numpy, lmdb, xxhash, zstandard and fsspec: when that import fails
the rows of ours are skipped with the reason and the rest still runs.

The job: the project's llama (``trainer.model.Transformer`` via ``trainer.model.build``) on random
tokens, fp32 parameters and AdamW (betas 0.9/0.95, ``clip_grad_norm_(1.0)``, as the trainer steps),
computing under ``torch.autocast(bfloat16)`` on CUDA (the trainer's mixed precision for an
unwrapped model) and in fp32 on CPU. ``--model-size 1b`` (default on CUDA): dim 2048, 16 layers,
16 heads, vocab 32000 (Llama-2's), seq len 2048; ``debug`` (default on CPU) and ``small``: the
trainer's flavors with its byte vocabulary (258).

Parts (each runs on its own; one that fails is reported as failed, in one line, and the rest runs):

1. D2H bandwidth (CUDA only): ``copy_`` of one 1 GiB device tensor into pinned (and, for context,
   pageable) host memory, synchronised; GB/s = 10^9 bytes per second.
2. Stall per save. Per method: one untimed, drained warm-up save, then ``--saves`` saves, each
   followed by two plain steps; before every save the previous save's write is drained *outside*
   the timing (this part measures staging, not storage) and the device is synchronised.
   **Stall** = host time inside the save call (the device queue is empty then, so the device idles
   for all of it) + the wait before the next ``optimizer.step()``: on CUDA the time the compute
   stream waited between the end of forward/backward and the start of the optimizer kernels (CUDA
   events recorded right after backward and in an optimizer step pre-hook registered after
   ours), which covers both a stream wait (ours) and a host wait (DCP's staging future); on CPU the
   host time blocked (``bench_stall.py``'s definition). **Time lost** = the synchronised wall time
   of save + next step minus the median plain step of the same phase (adds any slowdown of the
   compute by the copy running beside it).

   bare D2H copy      ``copy_(non_blocking=True)`` of every state tensor into pinned buffers
                      preallocated at set-up, then ``synchronize``: the copy not overlapped at all.
   ours               ``ckpt.CheckpointManager(dir, interval=1, keep=1, async_mode="double_buffer")``
                      + ``attach(optimizer)``; ``manager.save(step, {"model", "optim"})``: pinned
                      double buffer, device->host copy on a side stream, the compute stream made to
                      wait on its event in the optimizer pre-hook.
   DCP pinned         ``dcp.async_save(get_state_dict(model, opt), storage_writer=FileSystemWriter,
                      async_stager=DefaultStager(StagingOptions(use_pinned_memory=True,
                      use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True)))``
                      (torchtitan's ``async_with_pinned_mem``); waits for ``staging_completion``
                      before the next ``optimizer.step()``. CUDA only (the options need a device).
   DCP default        the same with ``async_stager=None``: the writer stages (a fresh pageable CPU
                      copy, synchronously, inside ``async_save``).

3. Tokens/s. Phases of ``--steps`` steps in windows of ``--every`` steps (synchronised at window
   ends; tokens/s per window), a save at the start of every window (after an untimed, drained
   warm-up of two saves in a row), everything counted: saves, waits for earlier writes (DCP's one
   upload in flight, our two buffer sets), the copies beside the compute. A no-save phase runs before, between and
   after the checkpointing phases (ours, then DCP pinned on CUDA / DCP default on CPU); each
   method is compared with the mean of its two adjacent no-save phases. MFU = model FLOPs/s / the
   device's peak dense bf16 FLOP/s (``trainer.metrics.peak_flops``: H200/H100 989 TFLOP/s; unknown
   device or CPU: not reported), with FLOPs per token from ``trainer.model.flops_per_token``:
   6 x non-embedding parameters + 12 x layers x dim x seq_len (torchtitan's convention).

Checkpoints go to ``--dir`` or, on CUDA when it has room for 3 x the state, to ``/dev/shm``
(tmpfs, so that the disk is not what is measured), else to ``benchmarks/_work``. A time budget
(``--budget``) skips the remaining phases, with a note, when it runs out. Results: a markdown
section (printed; ``--out FILE`` adds or replaces it there) and the JSON record (``--json PATH``;
without ``--json`` it goes to ``benchmarks/results/accelerator.json``, the runner's store, unless
``--no-store``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from harness import (  # first: puts this checkout's root on sys.path
    REPO, Load, argument_parser, command_line, goal, machine_description, median, median_span, metric,
    provenance, publish, settle, verdict, work_dir, write_json, model_and_optimizer_tensors,
)

from trainer import model as model_mod  # noqa: E402
from trainer.metrics import peak_flops  # noqa: E402

try:  # the engine pulls numpy, lmdb, xxhash, zstandard, fsspec: a device image may lack one
    import ckpt  # noqa: E402

    CKPT_ERROR = None
except Exception as exc:  # noqa: BLE001 - any import failure only disables our rows
    ckpt, CKPT_ERROR = None, f"{type(exc).__name__}: {exc}"

try:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    DCP_ERROR = None
except Exception as exc:  # noqa: BLE001 - a torch built without distributed
    dcp, DCP_ERROR = None, f"{type(exc).__name__}: {exc}"

BENCH_NAME = "accelerator"
SECTION = "## Accelerator: staging, stall and tokens/s (bench_accel.py)"
GOAL_RATIO = 0.05
STALL_GAP = 3  # steps per save in the stall part: the save's own step + 2 plain ones (the reference)
STORE = REPO / "benchmarks" / "results" / f"{BENCH_NAME}.json"

SYSTEMS_CUDA = {
    "copy": "bare D2H copy",
    "ours": "ours (pinned double buffer, side stream)",
    "dcp-pinned": "DCP async_save (pinned, torchtitan async_with_pinned_mem)",
    "dcp-default": "DCP async_save (default stager)",
    "none": "no checkpoint",
}
SYSTEMS_CPU = {**SYSTEMS_CUDA, "copy": "bare host copy (CPU)", "ours": "ours (double buffer, background thread; CPU)"}

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
warnings.filterwarnings("ignore", message=".*TypedStorage.*")


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text[:300]}"


class Skip(Exception):
    """A part that cannot run here (the reason is its message); not a failure."""


# ---------------------------------------------------------------------------------------------
# Process group and machine
# ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(device: str) -> str:
    """A 1-rank group through env:// (address and port set when absent); returns its backend."""
    if dcp is None or not dist.is_available():
        raise Skip("torch.distributed is not available in this torch build")
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise Skip("this benchmark runs one rank; WORLD_SIZE is " + os.environ["WORLD_SIZE"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=0, world_size=1)
    if device == "cuda":  # the NCCL half works: one all-reduce of a device tensor
        probe = torch.ones(4, device="cuda")
        dist.all_reduce(probe)
        torch.cuda.synchronize()
        if probe.sum().item() != 4:
            raise RuntimeError("NCCL all_reduce over 1 rank changed the tensor")
    return backend


def gpu_lines() -> list[str]:
    """GPU name, memory, SMs, driver and link (nvidia-smi when present), CUDA runtime, cuDNN."""
    props = torch.cuda.get_device_properties(0)
    driver, link = "unknown (no nvidia-smi)", ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current",
                              "--format=csv,noheader", "-i", "0"], capture_output=True, text=True, timeout=10).stdout
        fields = [f.strip() for f in out.strip().split(",")]
        if fields and fields[0]:
            driver = fields[0]
        if len(fields) == 3:
            link = f"; PCIe gen {fields[1]} x{fields[2]} (current)"
    except (OSError, subprocess.SubprocessError):
        pass
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return [f"GPU: {torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.0f} GiB, "
            f"{props.multi_processor_count} SMs; driver {driver}; CUDA runtime {torch.version.cuda}"
            f"{f'; cuDNN {cudnn}' if cudnn else ''}; torch {torch.__version__}{link}"]


# ---------------------------------------------------------------------------------------------
# The training job
# ---------------------------------------------------------------------------------------------
def model_args(size: str, seq_len: int) -> model_mod.ModelArgs:
    if size == "1b":
        return model_mod.ModelArgs(dim=2048, n_layers=16, n_heads=16, vocab_size=32000,
                                   max_seq_len=max(seq_len, 2048))
    return model_mod.model_args(size, max_seq_len=max(seq_len, model_mod.FLAVORS[size].max_seq_len))


class GpuWaitProbe:
    """How long the compute stream waited before the optimizer kernels: an event recorded right
    after backward (``arm``) and one in an optimizer step pre-hook registered after the method's
    own (so it is queued behind the manager's stream wait, or after DCP's host wait)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.armed = False
        self.handle = optimizer.register_step_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        if self.armed:
            self.end.record()
            self.armed = False

    def arm(self) -> None:
        self.start.record()
        self.armed = True

    def elapsed_s(self) -> float:  # after a synchronize
        return self.start.elapsed_time(self.end) / 1e3

    def remove(self) -> None:
        self.handle.remove()


class Job:
    """The llama, AdamW and one fixed batch of random tokens on ``device``."""

    def __init__(self, device: str, size: str, batch: int, seq_len: int, seed: int = 0):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.args = model_args(size, seq_len)
        self.size, self.batch, self.seq_len = size, batch, seq_len
        torch.manual_seed(seed)
        with torch.device(self.device):
            self.model = model_mod.build(self.args)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        tokens = torch.randint(0, self.args.vocab_size, (batch, seq_len + 1), device=self.device)
        self.inputs, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.params = model_mod.num_params(self.model)
        self.flops_per_token = model_mod.flops_per_token(self.args, seq_len)
        self.step_no = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def forward_backward(self) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            logits = self.model(self.inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), self.labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)

    def step(self, method: Method | None = None, probe: GpuWaitProbe | None = None) -> float:
        """One training step; returns the host time blocked by ``method`` before/at the optimizer
        step (its ``before_step`` plus waits inside the optimizer pre-hooks)."""
        self.forward_backward()
        if probe is not None:
            probe.arm()
        t0 = time.perf_counter()
        if method is not None:
            method.before_step()
        host = time.perf_counter() - t0
        hooked = method.hook_wait() if method is not None else 0.0
        self.opt.step()
        if method is not None:
            host += method.hook_wait() - hooked
        self.opt.zero_grad(set_to_none=True)
        self.step_no += 1
        return host

    def state_tensors(self) -> list[torch.Tensor]:
        return model_and_optimizer_tensors(self.model, self.opt)

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.state_tensors())

    def describe(self) -> str:
        a = self.args
        vocab = "vocab 32000 (Llama-2's)" if a.vocab_size == 32000 else f"byte vocab {a.vocab_size}"
        precision = ("bf16 autocast, fp32 parameters + AdamW state" if self.cuda
                     else "fp32 (no autocast on CPU)")
        return (f"llama `{self.size}`: dim {a.dim}, {a.n_layers} layers, {a.n_heads} heads "
                f"({a.kv_heads} kv), FFN {model_mod.ffn_hidden_dim(a)}, {vocab}; {self.params / 1e6:.1f} M parameters; "
                f"batch {self.batch} x seq {self.seq_len} = {self.tokens_per_step} tokens/step; {precision}; "
                f"AdamW + clip_grad_norm_(1.0); state (weights + exp_avg + exp_avg_sq + step) "
                f"{self.state_bytes() / 2**30:.2f} GiB in {len(self.state_tensors())} tensors")


# ---------------------------------------------------------------------------------------------
# Checkpointing methods
# ---------------------------------------------------------------------------------------------
class Method:
    key = ""

    def __init__(self, job: Job, root: Path, distributed: bool):
        self.job, self.root, self.distributed = job, root, distributed
        self.durable: list[float] = []  # seconds from a save's start until its bytes were committed
        self.notes: list[str] = []

    def setup(self) -> None:
        pass

    def save(self, step: int) -> None:
        raise NotImplementedError

    def before_step(self) -> None:
        """Right before ``optimizer.step()`` (DCP: wait for its staging)."""

    def hook_wait(self) -> float:
        """Cumulative host seconds waited inside the optimizer pre-hooks (ours: manager stats)."""
        return 0.0

    def drain(self) -> None:
        """Wait for every write in flight."""

    def close(self) -> None:
        pass

    def _on_durable(self, future: Future, start: float) -> None:
        future.add_done_callback(lambda _f: self.durable.append(time.perf_counter() - start))


class BareCopy(Method):
    key = "copy"

    def setup(self) -> None:
        self.dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.job.cuda) for t in self.job.state_tensors()]
        for d in self.dst:
            d.fill_(0)  # fault the pages in

    def save(self, step: int) -> None:
        for src, dst in zip(self.job.state_tensors(), self.dst):
            dst.copy_(src, non_blocking=self.job.cuda)
        self.job.sync()

    def close(self) -> None:
        self.dst = []


class Ours(Method):
    key = "ours"

    def setup(self) -> None:
        if ckpt is None:
            raise Skip(f"`import ckpt` failed: {CKPT_ERROR}")
        self.started: dict[int, float] = {}
        self.manager = ckpt.CheckpointManager(self.root, interval=1, keep=1, async_mode="double_buffer",
                                              device_type=self.job.device.type, on_commit=self._committed)
        self.manager.attach(self.job.opt)
        self.state = {"model": self.job.model, "optim": self.job.opt}

    def _committed(self, commit) -> None:  # the manager's writer thread, at the commit
        start = self.started.pop(commit.step, None)
        if start is not None:
            self.durable.append(time.perf_counter() - start)

    def save(self, step: int) -> None:
        self.started[step] = time.perf_counter()
        self.manager.save(step, self.state, force=True)

    def hook_wait(self) -> float:
        return self.manager.stats.stall_s

    def drain(self) -> None:
        self.manager.wait()

    def close(self) -> None:
        if hasattr(self, "manager"):
            host = self.manager.stats.host_buffer_bytes
            self.notes.append(f"host buffers {host / 2**30:.2f} GiB = {host / max(self.job.state_bytes(), 1):.2f}× the state")
            self.manager.close()


class DCPDefault(Method):
    key = "dcp-default"

    def __init__(self, job: Job, root: Path, distributed: bool):
        super().__init__(job, root, distributed)
        self.stager = None
        self.upload: Future | None = None
        self.staging: Future | None = None
        self.dirs: list[Path] = []

    def make_stager(self):
        return None

    def setup(self) -> None:
        if dcp is None:
            raise Skip(f"torch.distributed.checkpoint unavailable: {DCP_ERROR}")
        self.stager = self.make_stager()

    def save(self, step: int) -> None:
        start = time.perf_counter()
        if self.upload is not None:
            self.upload.result()  # DCP's contract: one async_save in flight
        model_sd, optim_sd = get_state_dict(self.job.model, self.job.opt)
        path = self.root / f"step-{step:08d}"
        self.dirs.append(path)
        resp = dcp.async_save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(path),
                              async_stager=self.stager, no_dist=not self.distributed)
        if isinstance(resp, AsyncSaveResponse):
            self.staging, self.upload = resp.staging_completion, resp.upload_completion
        else:
            self.staging, self.upload = None, resp
        self._on_durable(self.upload, start)
        older = self.dirs[:-1]
        # Retention, as ours does on its writer thread: the older checkpoints go once this one is written.
        self.upload.add_done_callback(lambda _f: [shutil.rmtree(d, ignore_errors=True) for d in older])

    def before_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self) -> None:
        self.before_step()
        if self.upload is not None:
            self.upload.result()

    def close(self) -> None:
        self.drain()
        if self.stager is not None:
            self.stager.close()


class DCPPinned(DCPDefault):
    key = "dcp-pinned"

    def make_stager(self):
        if not self.job.cuda:
            raise Skip("StagingOptions(use_pinned_memory=True, use_non_blocking_copy=True) needs an accelerator")
        return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                            use_async_staging=True, use_non_blocking_copy=True))


METHODS = {m.key: m for m in (BareCopy, Ours, DCPPinned, DCPDefault)}


# ---------------------------------------------------------------------------------------------
# Parts
# ---------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """One part (or one method's phase within a part): ok, skipped or failed, and why."""

    part: str
    status: str = "ok"
    detail: str = ""


@dataclass
class StallResult:
    key: str
    stall: list[float] = field(default_factory=list)
    in_save: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    host_wait: list[float] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    plain: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class PhaseResult:
    key: str
    rates: list[float] = field(default_factory=list)  # tokens/s per window
    elapsed: float = 0.0
    tokens: int = 0
    drain_s: float = 0.0
    peak_mem: int | None = None
    durable: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.elapsed if self.elapsed else float("nan")


class Runner:
    """Runs the parts, each guarded: a failure is recorded in one line and the run goes on."""

    def __init__(self, args: argparse.Namespace, device: str):
        self.args, self.device = args, device
        self.cuda = device == "cuda"
        self.systems = SYSTEMS_CUDA if self.cuda else SYSTEMS_CPU
        self.deadline = time.monotonic() + args.budget
        self.outcomes: list[Outcome] = []
        self.distributed = False
        self.backend = "none"
        self.job: Job | None = None
        self.d2h: dict[str, list[float]] = {}
        self.d2h_bytes = 0
        self.stalls: dict[str, StallResult] = {}
        self.phases: list[PhaseResult] = []

    def guarded(self, part: str, fn: Callable[[], Any], cleanup: Callable[[], None] | None = None) -> Any:
        if time.monotonic() > self.deadline:
            self.outcomes.append(Outcome(part, "skipped", f"time budget (--budget {self.args.budget:.0f} s) spent"))
            print(f"[{part}] skipped: time budget spent", flush=True)
            return None
        t0 = time.perf_counter()
        try:
            result = fn()
            self.outcomes.append(Outcome(part, "ok", f"{time.perf_counter() - t0:.1f} s"))
            return result
        except Skip as why:
            self.outcomes.append(Outcome(part, "skipped", str(why)))
            print(f"[{part}] skipped: {why}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one part failing must not end the run
            self.outcomes.append(Outcome(part, "failed", one_line(exc)))
            print(f"[{part}] FAILED: {one_line(exc)}", flush=True)
            if self.args.traceback:
                traceback.print_exc()
        finally:
            if cleanup is not None:
                try:
                    cleanup()
                except Exception as exc:  # noqa: BLE001
                    print(f"[{part}] clean-up failed: {one_line(exc)}", flush=True)
            self.free_memory()
        return None

    def free_memory(self) -> None:
        settle()
        if self.cuda:
            torch.cuda.empty_cache()
            # Freed pinned blocks stay cached by torch's host allocator: hand them back, so that one
            # phase's buffers do not add up with the next one's (host RAM also holds tmpfs checkpoints).
            empty_host = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                          or getattr(torch._C, "_host_emptyCache", None))
            if empty_host is not None:
                empty_host()

    # -- part 0: process group, job ----------------------------------------------------------------
    def start(self) -> None:
        def pg() -> None:
            self.backend = init_process_group(self.device)
            self.distributed = True
            print(f"[process group] 1 rank, backend {self.backend}, env:// at "
                  f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)

        self.guarded("process group", pg)

        def build() -> None:
            a = self.args
            job = Job(self.device, a.model_size, a.batch, a.seq_len)
            for _ in range(3):  # untimed: AdamW creates its state, kernels and autotuning warm up
                job.step()
            job.sync()
            self.job = job
            print(f"[job] {job.describe()}", flush=True)

        self.guarded("build model", build)

    # -- part 1: D2H bandwidth ------------------------------------------------------------------------
    def bandwidth(self) -> None:
        if not self.cuda:
            raise Skip("needs CUDA")
        n = 1 << 30
        src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
        self.d2h_bytes = n
        for label, pinned in (("pinned", True), ("pageable", False)):
            dst = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            dst.fill_(0)
            dst.copy_(src, non_blocking=pinned)  # untimed first copy
            torch.cuda.synchronize()
            rates = []
            for _ in range(self.args.repeats_d2h):
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                torch.cuda.synchronize()
                rates.append(n / (time.perf_counter() - t0) / 1e9)
            self.d2h[label] = rates
            print(f"[D2H {label}] {median_span(rates, 2)} GB/s", flush=True)
            del dst

    # -- part 2: stall per save -----------------------------------------------------------------------
    def stall_phase(self, key: str, work: Path) -> None:
        job = self.job
        method = METHODS[key](job, work / f"stall-{key}", self.distributed)
        res = StallResult(key)
        probe = None

        def run() -> None:
            nonlocal probe
            method.setup()
            probe = GpuWaitProbe(job.opt) if job.cuda else None  # after the manager's pre-hook
            method.save(job.step_no)  # untimed warm-up: buffers, pinning, first-call costs
            job.step(method, probe)
            method.drain()
            method.durable.clear()
            for _ in range(self.args.saves):
                method.drain()  # outside the timing: this part measures staging, not storage
                job.sync()
                t0 = time.perf_counter()
                method.save(job.step_no)
                in_save = time.perf_counter() - t0
                host_wait = job.step(method, probe)
                job.sync()
                total = time.perf_counter() - t0
                wait = probe.elapsed_s() if probe is not None else host_wait
                res.in_save.append(in_save)
                res.wait.append(wait)
                res.host_wait.append(host_wait)
                res.stall.append(in_save + wait)
                res.lost.append(total)  # minus the plain step's median below
                for _ in range(STALL_GAP - 1):
                    t1 = time.perf_counter()
                    job.step(method)
                    job.sync()
                    res.plain.append(time.perf_counter() - t1)
            method.drain()
            ref = median(res.plain)
            res.lost = [t - ref for t in res.lost]
            res.durable = list(method.durable)
            self.stalls[key] = res
            print(f"[stall {key}] stall {median_span(res.stall, 4)} s (in save {median(res.in_save):.4f}, "
                  f"wait {median(res.wait):.4f}); lost {median(res.lost):.4f} s; plain step {ref:.4f} s", flush=True)

        def cleanup() -> None:
            if probe is not None:
                probe.remove()
            method.close()
            res.notes.extend(method.notes)
            shutil.rmtree(method.root, ignore_errors=True)

        self.guarded(f"stall: {self.systems[key]}", run, cleanup)

    # -- part 3: tokens/s -------------------------------------------------------------------------------
    def throughput_phase(self, key: str, work: Path, label: str) -> None:
        job = self.job
        method = METHODS[key](job, work / f"tokens-{key}", self.distributed) if key != "none" else None
        res = PhaseResult(key)
        every, windows = self.args.every, max(1, self.args.steps // self.args.every)

        def run() -> None:
            if method is not None:
                method.setup()
                for _ in range(2):  # untimed warm-up: two saves in a row, so that ours allocates (and
                    method.save(job.step_no)  # pins) its second buffer set here, not in a timed window
                    job.step(method)
                method.drain()
                method.durable.clear()
            job.sync()
            if job.cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(windows):
                t0 = time.perf_counter()
                if method is not None:
                    method.save(job.step_no)
                for _ in range(every):
                    job.step(method)
                job.sync()
                res.rates.append(every * job.tokens_per_step / (time.perf_counter() - t0))
            res.elapsed = time.perf_counter() - start
            res.tokens = windows * every * job.tokens_per_step
            if job.cuda:
                res.peak_mem = torch.cuda.max_memory_allocated()
            if method is not None:
                t = time.perf_counter()
                method.drain()
                res.drain_s = time.perf_counter() - t
                res.durable = list(method.durable)
            self.phases.append(res)
            print(f"[tokens/s {label}] {median_span(res.rates, 0)} per window; phase {res.rate:.0f}"
                  + (f"; drain {res.drain_s:.2f} s" if method is not None else ""), flush=True)

        def cleanup() -> None:
            if method is not None:
                method.close()
                res.notes.extend(method.notes)
                shutil.rmtree(method.root, ignore_errors=True)

        self.guarded(f"tokens/s: {label}", run, cleanup)

    # -- the whole run ----------------------------------------------------------------------------------
    def run(self, parent: str | None) -> dict:
        self.start()
        info: dict = {}
        self.guarded("D2H bandwidth", self.bandwidth)
        if self.job is None:
            return info
        nbytes = self.job.state_bytes()
        if parent is None and self.cuda:
            parent = shm_parent(nbytes)
        try:
            with work_dir(parent, "accel-", keep=self.args.keep) as work:
                info["work"] = work
                for key in ("copy", "ours", "dcp-pinned", "dcp-default"):
                    self.stall_phase(key, work)
                with_saves = ["ours", "dcp-pinned" if self.cuda else "dcp-default"]
                self.throughput_phase("none", work, f"{self.systems['none']} #1")
                for i, key in enumerate(with_saves):  # a no-save phase after each: two neighbours per method
                    self.throughput_phase(key, work, self.systems[key])
                    self.throughput_phase("none", work, f"{self.systems['none']} #{i + 2}")
        except OSError as exc:  # the work dir itself (creating or removing it); the parts are guarded
            self.outcomes.append(Outcome("work dir", "failed", one_line(exc)))
            print(f"[work dir] FAILED: {one_line(exc)}", flush=True)
        return info

    def close(self) -> None:
        if dcp is not None and dist.is_available() and dist.is_initialized():  # also after a half-done init
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001
                print(f"[process group] destroy failed: {one_line(exc)}", flush=True)


def shm_parent(nbytes: int) -> str | None:
    """/dev/shm when it has room for 3 x the state (keep=1 + one in flight + margin), else None."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free >= 3 * nbytes:
            return str(shm / "ckpt-bench-accel")
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def report(r: Runner, info: dict, args: argparse.Namespace, command: str, machine: list[str],
           load: str) -> tuple[str, list[dict], list[dict]]:
    S = r.systems
    metrics: list[dict] = []
    goals: list[dict] = []
    lines = [SECTION, ""]
    job = r.job
    device_line = (f"Device: **{torch.cuda.get_device_name(0)}** (CUDA)" if r.cuda
                   else "Device: **CPU** (no CUDA here: a dry run that proves the script; the numbers are not the accelerator's)")
    lines.append(f"{device_line}; process group: 1 rank, backend `{r.backend}` (env://).")
    if job is not None:
        lines.append(f"Job: {job.describe()}.")
        if "work" in info:
            lines.append(f"Checkpoints written under `{info['work']}`.")
    lines.append("")

    if not r.cuda:
        lines += ["Skipped on CPU: raw D2H bandwidth (needs CUDA); DCP async_save with pinned memory "
                  "(`use_pinned_memory`/`use_non_blocking_copy` need an accelerator; the tokens/s part runs DCP's "
                  "default stager in its place); NCCL (gloo instead); bf16 autocast (fp32 on CPU); MFU (no peak "
                  "FLOP/s for a CPU); the goal stall ≤ 0.05× bare D2H copy (it is about a device→host copy).", ""]
    problems = [o for o in r.outcomes if o.status != "ok"]
    if problems:
        lines.append("Parts not measured:")
        lines += [f"- {o.part}: **{o.status}** — {o.detail}" for o in problems]
        lines.append("")

    # D2H bandwidth
    if r.d2h:
        lines += ["### Device→host bandwidth", "",
                  "| Copy | GB/s, median (min–max) | Size |", "|---|---:|---:|"]
        for label, rates in r.d2h.items():
            lines.append(f"| `copy_` of one device tensor into {label} host memory, synchronised | "
                         f"{median_span(rates, 2)} | {r.d2h_bytes / 2**30:.0f} GiB |")
            metrics.append(metric(f"raw D2H ({label})", "d2h_gbps", "GB/s", rates))
        if job is not None and "pinned" in r.d2h:
            lines += ["", f"At the pinned rate the job's state ({job.state_bytes() / 2**30:.2f} GiB) copies in "
                      f"{job.state_bytes() / median(r.d2h['pinned']) / 1e9:.3f} s."]
        lines.append("")

    # Stall
    copy = r.stalls.get("copy")
    copy_stall = median(copy.stall) if copy else None
    if r.stalls:
        wait_what = ("compute stream's wait before the optimizer kernels (CUDA events)" if r.cuda
                     else "host time blocked before/at `optimizer.step()`")
        lines += [f"### Stall per save ({args.saves} saves per method, writes drained between saves)", "",
                  f"| Method | Stall s, median (min–max) | × {S['copy']} | in save() s | wait before next opt.step s "
                  "| Time lost per save s | Durable after s | Notes |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for key in METHODS:
            res = r.stalls.get(key)
            if res is None:
                continue
            s = median(res.stall)
            ratio = f"{s / copy_stall:.3f}" if copy_stall else "–"
            durable = median_span(res.durable, 2) if res.durable else "–"
            note = "; ".join(res.notes) or ""
            if key != "copy" and r.cuda:
                note = (note + "; " if note else "") + f"host wait {median(res.host_wait):.4f} s"
            lines.append(f"| {S[key]} | {median_span(res.stall, 4)} | {ratio} | {median(res.in_save):.4f} "
                         f"| {median(res.wait):.4f} | {median_span(res.lost, 4)} | {durable} | {note} |")
            metrics.append(metric(S[key], "stall_s", "s", res.stall))
            metrics.append(metric(S[key], "lost_s", "s", res.lost))
        ref = median([x for res in r.stalls.values() for x in res.plain])
        lines += ["", f"Plain step (median over the part's reference steps): {ref:.4f} s. *Stall* = *in save()* "
                  f"(host time in the save call, started on an idle device) + *wait before next opt.step* "
                  f"({wait_what}). *Time lost* = synchronised wall time of save + the next step − the median plain "
                  "step of the same method's phase (adds the slowdown of compute by a copy running beside it; "
                  "noise of a few ms either way). *Durable after*: from the save call until its bytes were "
                  "committed (drained before the next save, outside the timing).", ""]
        ours = r.stalls.get("ours")
        if r.cuda:
            measured = median(ours.stall) / copy_stall if ours and copy_stall else None
            detail = (f"median over {len(ours.stall)} saves: ours {median(ours.stall):.4f} s "
                      f"(min–max {min(ours.stall):.4f}–{max(ours.stall):.4f}) vs bare D2H copy {copy_stall:.4f} s"
                      if measured is not None else "not measured (see the parts not measured)")
            goals.append(goal(f"stall ≤ {GOAL_RATIO}× bare D2H copy", measured, GOAL_RATIO, "<=", detail))
            lines += [f"Goal stall ≤ {GOAL_RATIO}× bare D2H copy: "
                      f"{verdict(None if measured is None else measured <= GOAL_RATIO)} "
                      f"({'n/a' if measured is None else f'{measured:.3f}×'}; {detail}).", ""]

    # Tokens/s
    if r.phases:
        peak = peak_flops(torch.cuda.get_device_name(0)) if r.cuda else None
        n_base = 0
        lines += [f"### Tokens/s (a save every {args.every} steps; windows of {args.every} steps)", "",
                  "| Phase | tokens/s per window, median (min–max) | × no save (adjacent) | MFU % | Peak device memory GiB "
                  "| Durable after s | Drain at end s |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for i, p in enumerate(r.phases):
            near = [q for q in r.phases[max(i - 1, 0): i + 2] if q.key == "none" and q is not p]
            if p.key == "none":
                ratio = "–"
            else:
                ref = sum(q.rate for q in near) / len(near) if near else None
                ratio = f"{p.rate / ref:.3f}" if ref else "–"
            mfu = [100 * x * job.flops_per_token / peak for x in p.rates] if peak else None
            mem = f"{p.peak_mem / 2**30:.1f}" if p.peak_mem is not None else "–"
            durable = median_span(p.durable, 2) if p.durable else "–"
            n_base += p.key == "none"
            name = S[p.key] + (f" #{n_base}" if p.key == "none" else "")
            lines.append(f"| {name} | {median_span(p.rates, 0)} | {ratio} | "
                         f"{median_span(mfu, 1) if mfu else 'n/a'} | {mem} | {durable} | "
                         f"{f'{p.drain_s:.2f}' if p.key != 'none' else '–'} |")
        for key in dict.fromkeys(p.key for p in r.phases):
            rates = [x for p in r.phases if p.key == key for x in p.rates]
            metrics.append(metric(S[key], "tokens_per_s", "tokens/s", rates))
            if peak:
                metrics.append(metric(S[key], "mfu", "%", [100 * x * job.flops_per_token / peak for x in rates]))
        lines += ["", f"Each phase: {max(1, args.steps // args.every)} windows of {args.every} steps, synchronised at "
                  "window ends; a checkpointing phase saves at the start of every window (after an untimed, drained "
                  "warm-up of two saves in a row) and counts everything: the save calls, waits for earlier writes "
                  "(DCP: one upload in flight; ours: two buffer sets), copies beside the compute. *× no save*: the phase's overall rate "
                  "over the mean of the no-save phases right before and after it. MFU = "
                  f"{job.flops_per_token / 1e9:.2f} GFLOP/token (6 × non-embedding parameters + 12 × layers × dim × "
                  f"seq_len) × tokens/s / peak dense bf16 "
                  + (f"{peak / 1e12:.0f} TFLOP/s." if peak else "(unknown for this device: not reported).")
                  + " *Drain at end*: waiting for the last save's write after the phase (not in tokens/s).", ""]

    lines += ["Rows: *bare D2H copy* — `copy_` of every state tensor into pinned buffers preallocated at set-up, "
              "then synchronize (the copy with no overlap; on CPU: plain host buffers); *ours* — `ckpt.CheckpointManager(async_mode=\"double_buffer\")` "
              "+ `attach(optimizer)`: pinned double buffer, device→host copy on a side stream, the compute stream "
              "ordered after it in the optimizer pre-hook (on CPU: a background copy thread); *DCP async_save (pinned)* — "
              "`DefaultStager(StagingOptions(True, False, True, True))`, torchtitan's `async_with_pinned_mem`, "
              "waiting for `staging_completion` before the next `optimizer.step()`; *DCP async_save (default stager)* — "
              "`async_stager=None`: `FileSystemWriter` stages a fresh pageable CPU copy inside the call. DCP's state "
              "dict is `get_state_dict(model, optimizer)`, made inside every save and counted.", ""]
    lines += provenance(machine, command, load=load)
    return "\n".join(lines), metrics, goals


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argument_parser(__doc__, keep=True)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto (default): cuda when available, else cpu")
    parser.add_argument("--cpu-only", action="store_true", help="the same as --device cpu")
    parser.add_argument("--quick", action="store_true", help="fewer saves and steps (and batch 2 on CUDA)")
    parser.add_argument("--model-size", choices=["debug", "small", "1b"],
                        help="default 1b on CUDA (dim 2048, 16 layers, vocab 32000), debug on CPU")
    parser.add_argument("--batch", type=int, help="sequences per step (default 4; 2 with --quick on CUDA)")
    parser.add_argument("--seq-len", type=int, help="default 2048 on CUDA, 128 on CPU")
    parser.add_argument("--saves", type=int, help="timed saves per method in the stall part (default 3, quick 2)")
    parser.add_argument("--steps", type=int, help="steps per tokens/s phase (default CUDA 30, quick 10; CPU 12, quick 8)")
    parser.add_argument("--every", type=int, help="save every N steps in the tokens/s part (default CUDA 10, quick 5; CPU 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1; CUDA: untouched)")
    parser.add_argument("--repeats-d2h", type=int, default=5, help="timed copies per D2H bandwidth row (default 5)")
    parser.add_argument("--budget", type=float, help="seconds after which the remaining phases are skipped "
                                                     "(default CUDA 390, quick 200; CPU 80)")
    parser.add_argument("--no-store", action="store_true",
                        help=f"without --json, do not write {STORE.relative_to(REPO)} either")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of a failed part")
    args = parser.parse_args(argv)
    if args.cpu_only:
        args.device = "cpu"
    return args


def resolve(args: argparse.Namespace) -> str:
    """The device, and every default that depends on it."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_accel: --device cuda, but torch.cuda.is_available() is False "
                         f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    cuda, quick = device == "cuda", args.quick
    defaults = {
        "model_size": "1b" if cuda else "debug",
        "batch": (2 if quick else 4) if cuda else 4,
        "seq_len": 2048 if cuda else 128,
        "saves": 2 if quick else 3,
        "steps": (10 if quick else 30) if cuda else (8 if quick else 12),
        "every": (5 if quick else 10) if cuda else 4,
        "budget": (200 if quick else 390) if cuda else 80,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.batch, args.seq_len, args.saves, args.steps, args.every) < 1:
        raise SystemExit("bench_accel: --batch, --seq-len, --saves, --steps and --every must be >= 1")
    return device


def store(path: Path, mode: str, wall: float) -> None:
    """Add the fields run.py adds to its stored records (mode, wall time)."""
    record = json.loads(path.read_text())
    record.update(mode=mode, wall_s=round(wall, 1))
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    args = parse(argv)
    device = resolve(args)
    command = command_line("bench_accel.py", argv)
    print(f"bench_accel: device {device}, model {args.model_size}, batch {args.batch} x seq {args.seq_len}, "
          f"{args.saves} saves per method, {args.steps} steps per tokens/s phase, a save every {args.every}; "
          f"budget {args.budget:.0f} s", flush=True)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # one intra-op thread: the other cores are left to the checkpoint threads (and a shared box's
        torch.set_num_threads(args.threads)  # load, under which 2 spinning OpenMP threads run ~10x slower)
    runner = Runner(args, device)
    load = Load()
    try:
        info = runner.run(args.dir)
    finally:
        runner.close()
    machine = machine_description(info.get("work"), [f"torch threads {torch.get_num_threads()}"])
    if device == "cuda":
        try:
            machine += gpu_lines()
        except Exception as exc:  # noqa: BLE001
            machine.append(f"GPU: description failed ({one_line(exc)})")
    try:
        section, metrics, goals = report(runner, info, args, command, machine, load.stop().describe("during the run"))
    except Exception as exc:  # noqa: BLE001 - keep what was measured in the log; say why the report is missing
        print(f"bench_accel: building the report failed: {one_line(exc)}", flush=True)
        if args.traceback:
            traceback.print_exc()
        section = "\n".join([SECTION, "", f"Report failed: {one_line(exc)}.", "", *provenance(machine, command)])
        metrics, goals = [], []
    publish(section, args.out)
    params = {"device": device, "model_size": args.model_size, "batch": args.batch, "seq_len": args.seq_len,
              "saves": args.saves, "steps": args.steps, "every": args.every, "quick": args.quick,
              "outcomes": [o.__dict__ for o in runner.outcomes]}
    json_path = args.json or (None if args.no_store else str(STORE))
    write_json(json_path, BENCH_NAME, section, command, metrics=metrics, goals=goals, params=params)
    if json_path:  # run.py sets these two itself; a direct run (e.g. on the device machine) needs them too
        store(Path(json_path), "quick" if args.quick else "full", time.monotonic() - t_start)
        print(f"wrote {json_path}")
    failed = [o.part for o in runner.outcomes if o.status == "failed"]
    print(f"bench_accel: done in {time.monotonic() - t_start:.0f} s"
          + (f"; failed parts: {', '.join(failed)}" if failed else ""), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        raise
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - one readable line, not a traceback
        print(f"bench_accel: failed: {one_line(exc)}", file=sys.stderr, flush=True)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        sys.exit(1)

"""The ground the device checks (``device_checks.py``) stand on: what a check raises when it does not
hold or cannot run, the run's context, and the first section.

* :class:`Failed`: a check ran and did not hold (the figures it wrote say what was seen).
* :class:`Skipped`: a check cannot run here (no process group, no room); the reason is recorded.
* :class:`Context`: the device (CUDA, Ascend, or the CPU of a dry run) and its module, the work
  folder (``/dev/shm`` on a device), the time budget, what preflight found (``group``, ``notes``);
  ``sync()`` waits for the device.
* :func:`preflight`: the process group first (a ``cpu:gloo,<device>:<backend>`` group of one rank
  bound to the device; plain gloo if that cannot start), then versions, ``nvidia-smi``/``npu-smi``,
  room on the work folder and in host memory for the job's checkpoints, one all-reduce of a host and
  of a device tensor. Nothing before the group can stop it; what is short later is a note and a
  smaller run (checkpoints on disk instead of tmpfs), not a failure of every later section.

Engine modules are imported inside the functions: ``device_checks.py`` imports this module only
after ``import ckpt`` succeeded (exit 3 otherwise).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO  # first: puts this checkout's root on sys.path
from probes import meminfo

GIB = 1 << 30


def mem_available() -> int:
    return meminfo().get("MemAvailable", 0)


class Failed(Exception):
    """A check that ran and did not hold (the figures say what was seen)."""


class Skipped(Exception):
    """A check that cannot run here; the message says why."""


class Context:
    """The device the checks run on (``accel``: its torch module, None in a dry run), the work
    folder, the options, the time left of the budget, and what preflight found."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from ckpt.device import accelerator_module, resolve_device_type

        self.torch = torch
        self.dry = args.dry_run
        self.device_type = "cpu" if self.dry else resolve_device_type(args.device)
        self.accel = accelerator_module(self.device_type)
        if self.accel is None and not self.dry:
            raise SystemExit("device_checks: no CUDA GPU or Ascend NPU here (use --dry-run on a CPU)")
        self.device = torch.device(self.device_type, 0) if self.accel else torch.device("cpu")
        self.args = args
        self.deadline = time.monotonic() + args.budget
        self.work = Path(args.work or (("/dev/shm" if Path("/dev/shm").is_dir() and not self.dry
                                       else str(REPO / "benchmarks" / "_work")) + "/ckpt-device-checks"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.out = self.work  # device_checks.py sets the results folder
        self.group: str | None = None  # the backend of the process group preflight started
        self.room_for = 3  # checkpoints of the job's state the work folder holds (preflight measures it)
        self.shared_staging = True  # /dev/shm holds DCP's shared-memory staged copies (preflight says)

    def sync(self) -> None:
        if self.accel is not None:
            self.accel.synchronize()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def needs_group(self) -> None:
        if self.group is None:
            raise Skipped("no process group (preflight could not start one)")


def start_group(ctx: Context, figures: dict) -> None:
    """One rank's group, bound to the device; gloo alone when the device backend does not start.
    MASTER_ADDR/PORT name it, so DCP's checkpoint process finds its store without a DNS lookup."""
    import torch.distributed as dist

    from ckpt.device import process_group_backend
    from tests.support.launch import free_port

    port = free_port()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    backend = process_group_backend(ctx.device_type)
    tries = [(backend, {"device_id": ctx.device} if ctx.accel is not None else {})]
    if backend != "gloo":
        tries.append(("gloo", {}))
    if ctx.accel is not None:
        ctx.accel.set_device(0)
    for name, bound in tries:
        try:
            dist.init_process_group(name, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **bound)
            ctx.group = figures["backend"] = name
            return
        except Exception as exc:  # noqa: BLE001 - the next try, and the reason in the record
            figures[f"group_error_{name}"] = f"{type(exc).__name__}: {exc}"[:300]
            port = free_port()
            os.environ["MASTER_PORT"] = str(port)


def preflight(ctx: Context, figures: dict) -> None:
    import torch
    import torch.distributed as dist

    start_group(ctx, figures)
    figures.update(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                   device=ctx.device_type)
    if ctx.device_type == "npu":
        figures["torch_npu"] = getattr(sys.modules.get("torch_npu"), "__version__", "?")
    if ctx.accel is not None:
        figures["device_name"] = ctx.accel.get_device_name(0)
        figures["device_memory_gib"] = round(ctx.accel.get_device_properties(0).total_memory / GIB, 1)
    for tool, cmd in (("nvidia-smi", ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"]), ("npu-smi", ["npu-smi", "info"])):
        if shutil.which(tool):
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=15).stdout.strip()
                figures[tool] = " / ".join(out.splitlines()[:3])
            except (OSError, subprocess.SubprocessError) as exc:
                figures[tool] = f"failed: {exc}"
    room(ctx, figures)
    wrong = []
    for where in ("cpu", ctx.device_type) if ctx.group else ():
        try:
            probe = torch.ones(4, device=where)
            dist.all_reduce(probe)
            ctx.sync()
            figures[f"all_reduce_{where}"] = "ok" if float(probe.sum()) == 4.0 else f"wrong: {probe.tolist()}"
        except Exception as exc:  # noqa: BLE001 - reported; the sections that need it say so themselves
            figures[f"all_reduce_{where}"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        if figures[f"all_reduce_{where}"] != "ok":
            wrong.append(where)
    if ctx.group is None or wrong:
        raise Failed("no process group could start" if ctx.group is None else f"all-reduce on {wrong} did not hold")


SHM = Path("/dev/shm")


def room(ctx: Context, figures: dict) -> None:
    """Where the checkpoints go, and whether DCP may stage into shared memory.

    Host memory holds our two pinned buffer sets, DCP's staged copies (torchtitan's shared-memory
    stager: one a save, two alive while an upload drains; they live in /dev/shm) and, on tmpfs, up
    to 3 checkpoints. Checkpoints go to /dev/shm while it holds 3 of them beside DCP's 2 copies and
    host memory holds all that besides our buffers, else to the disk. torchtitan's pinned path is
    not run (noted) where /dev/shm cannot hold its 2 copies: a full /dev/shm kills the process that
    touches it (SIGBUS), and a container's is often 64 MB."""
    state = job_state_bytes(ctx)  # fp32 weights + AdamW moments of the jobs of overlap/stall/trainer
    shm_free = shutil.disk_usage(SHM).free if SHM.is_dir() else 0
    figures.update(job_state_gib=round(state / GIB, 2), mem_available_gib=round(mem_available() / GIB, 1),
                   shm_free_gib=round(shm_free / GIB, 1))
    if str(ctx.work).startswith(str(SHM)) and (shm_free < 5 * state or mem_available() < 7 * state):
        ctx.work = REPO / "benchmarks" / "_work" / "ckpt-device-checks"
        ctx.work.mkdir(parents=True, exist_ok=True)
        figures["work_note"] = "not enough room in /dev/shm or host memory for checkpoints on tmpfs: on disk instead"
    on_shm = str(ctx.work).startswith(str(SHM))
    ctx.shared_staging = shm_free - (3 * state if on_shm else 0) >= 2 * state
    if not ctx.shared_staging:
        figures["shared_staging_note"] = "/dev/shm cannot hold 2 staged copies: torchtitan's pinned path not run"
    free = shutil.disk_usage(ctx.work).free
    ctx.room_for = int(free // max(state, 1))
    figures.update(work=str(ctx.work), work_free_gib=round(free / GIB, 1), checkpoints_that_fit=ctx.room_for)
    if ctx.room_for < 3:
        figures["room_note"] = "fewer than 3 checkpoints fit: the sections that write them are skipped"


def job_state_bytes(ctx: Context) -> int:
    """What the jobs' state takes: 12 bytes per parameter (fp32 weights + AdamW's two moments)."""
    import torch

    from device_job import job_model_args
    from trainer import model as model_mod

    with torch.device("meta"):
        params = model_mod.num_params(model_mod.build(job_model_args(ctx)))
    return 12 * params

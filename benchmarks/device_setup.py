"""The ground the device checks (``device_checks.py``) stand on: what a check raises when it does not
hold, the run's context, and the first section.

* :class:`Failed`: a check ran and did not hold (the figures it wrote say what was seen).
* :class:`Context`: the device (CUDA, Ascend, or the CPU of a dry run) and its module, the work
  folder (``/dev/shm`` on a device), the time budget; ``sync()`` waits for the device.
* :func:`preflight`: versions, ``nvidia-smi``/``npu-smi``, room on the work folder and in host memory
  for the job's checkpoints, a ``cpu:gloo,<device>:<backend>`` group of one rank bound to the
  device and one all-reduce of a host and of a device tensor.

Engine modules are imported inside the functions: ``device_checks.py`` imports this module only
after ``import ckpt`` succeeded (exit 3 otherwise).
"""

from __future__ import annotations

import argparse
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


class Context:
    """The device the checks run on (``accel``: its torch module, None in a dry run), the work
    folder, the options and the time left of the budget."""

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

    def sync(self) -> None:
        if self.accel is not None:
            self.accel.synchronize()

    def left(self) -> float:
        return self.deadline - time.monotonic()


def preflight(ctx: Context, figures: dict) -> None:
    import torch
    import torch.distributed as dist

    from ckpt.device import process_group_backend
    from tests.support.launch import free_port

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
    state = job_state_bytes(ctx)  # fp32 weights + AdamW moments of the overlap/stall job
    figures["job_state_gib"] = round(state / GIB, 2)
    figures["mem_available_gib"] = round(mem_available() / GIB, 1)
    # Pinned buffers (two sets) + DCP's pinned copy + checkpoints on tmpfs (tmpfs is host memory too).
    if str(ctx.work).startswith("/dev/shm") and (shutil.disk_usage(ctx.work).free < 3 * state
                                                  or mem_available() < 7 * state):
        ctx.work = REPO / "benchmarks" / "_work" / "ckpt-device-checks"
        ctx.work.mkdir(parents=True, exist_ok=True)
        figures["work_note"] = "not enough host memory for checkpoints on tmpfs: on disk instead"
    figures["work"] = str(ctx.work)
    figures["work_free_gib"] = round(shutil.disk_usage(ctx.work).free / GIB, 1)
    if shutil.disk_usage(ctx.work).free < 3 * state:
        raise Failed(f"{ctx.work} has room for less than 3 checkpoints of {state / GIB:.1f} GiB")
    port = free_port()
    backend = process_group_backend(ctx.device_type)
    bound = {"device_id": ctx.device} if ctx.accel is not None else {}
    if ctx.accel is not None:
        ctx.accel.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **bound)
    figures["backend"] = backend
    for where in ("cpu", ctx.device_type):
        probe = torch.ones(4, device=where)
        dist.all_reduce(probe)
        ctx.sync()
        figures[f"all_reduce_{where}"] = "ok" if float(probe.sum()) == 4.0 else f"wrong: {probe.tolist()}"
    if any(str(v).startswith("wrong") for k, v in figures.items() if k.startswith("all_reduce")):
        raise Failed("an all-reduce changed its tensor")


def job_state_bytes(ctx: Context) -> int:
    """What the overlap/stall job's state takes: 16 bytes per parameter (fp32 weights + AdamW moments)."""
    import torch

    from device_training import job_model_args
    from trainer import model as model_mod

    with torch.device("meta"):
        params = model_mod.num_params(model_mod.build(job_model_args(ctx)))
    return 16 * params


#!/usr/bin/env python
"""The prepared run for a lent accelerator (CUDA GPU or Ascend NPU): does staging hold what it
promises on a real device, and what does it cost. One process, about 6 minutes on one H200.

    python benchmarks/device_checks.py                     # the device machine (its own torch)
    python benchmarks/device_checks.py --only stall,trainer
    python benchmarks/device_checks.py --dry-run           # CPU, tiny sizes: proves the script (CI runs it)

Sections, in order (each one's result is written as soon as it ends; SIGTERM writes what is there):

  preflight  versions, imports (exit 3 when ``import ckpt`` fails), nvidia-smi / npu-smi, free disk
             and memory, a ``cpu:gloo,<device>:<backend>`` group bound to the device + one all-reduce
             of a host and of a device tensor
  pinned     our buffer sets are pinned (a segment and a view at an offset: ``is_pinned()``), the
             host allocator's own figure beside ours, the sets released at close, and how long
             pinning 1/4/16 GiB takes (the first save pays it)
  ordering   tests/ckpt/test_accelerator.py (``pytest -m accelerator``: a snapshot equals the state
             after a device-delayed in-place add, and not a later one after ``wait_snapshot()``; a
             temporary source survives its copy; a DTensor on a device mesh; an FSDP2 manager save
             loaded bitwise) + the negative control: without the wait, the next in-place add reaches
             the snapshot (a mismatch count above zero shows the check can see a race)
  dtensor    the stale-bytes case at size: DTensors of a 1-rank device mesh staged, where the staged
             local tensor lives, whether its bytes equal the state, device memory during ``stage()``
  overlap    a ~1B llama (bf16 autocast, fp32 AdamW): one snapshot each with pinned buffers, pageable
             buffers, and with the host ahead of the device (no synchronize before the save); the
             copy/compute overlap read from a profiler trace (DtoH copies against kernels on other
             streams), the step time lost, the staged state compared with a device clone taken at the
             save (must be equal)
  stall      per save, ours (manager: pinned double buffer, side stream) vs DCP ``async_save`` with
             its pinned ``DefaultStager`` (torchtitan's ``async_with_pinned_mem``) and DCP's default:
             host time in the save and in its waits, the compute stream's wait (events), step time
             lost, the first (allocating) save apart; saves every ``--every`` steps to tmpfs
  trainer    ``python -m trainer.train`` on the device: 40 steps with checkpoints, a resumed run to
             60, an uninterrupted run to 60; losses after the resume against the uninterrupted run

Results: ``<out>/device_checks.json`` (every section: status ok/failed/skipped, seconds, figures)
and ``<out>/device_checks.md`` (a summary), ``<out>`` being ``--out``, else ``$OUT`` (the device
tool's folder), else ``benchmarks/_work/device_checks``. Exit 0 when no section failed, 1 when one
did, 3 when ``import ckpt`` fails. The wheels the device image lacks (``lmdb``, ``zstandard`` for
Python 3.12: ``bash benchmarks/device_wheels.sh``) are installed from ``benchmarks/_wheels`` into a
scratch folder first; the device machine reaches no package index.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "benchmarks" / "_wheels"
SCRATCH_SITE = Path("/tmp/ckpt-device-site")
NEEDED = ("numpy", "lmdb", "xxhash", "zstandard", "fsspec", "safetensors", "tqdm", "yaml")
SECTIONS = ("preflight", "pinned", "ordering", "dtensor", "overlap", "stall", "trainer")
GIB = 1 << 30


def install_missing_wheels() -> list[str]:
    """pip-install the carried wheels into a scratch site-packages when a dependency is missing."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing and any(WHEELS.glob("*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SCRATCH_SITE), *map(str, WHEELS.glob("*.whl"))],
                       check=False)
        sys.path.insert(0, str(SCRATCH_SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SCRATCH_SITE), str(REPO), os.environ.get("PYTHONPATH", "")])
        importlib.invalidate_caches()
    return missing


class Results:
    """The JSON record, rewritten (atomically) after every section."""

    def __init__(self, out: Path, argv: list[str]):
        self.out = out
        self.data = {"command": "python benchmarks/device_checks.py " + " ".join(argv), "started": time.time(),
                     "sections": {}}

    def record(self, name: str, status: str, seconds: float, figures: dict, error: str | None = None) -> None:
        self.data["sections"][name] = {"status": status, "seconds": round(seconds, 2), "figures": figures,
                                       **({"error": error} if error else {})}
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "device_checks.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.out / "device_checks.json")
        (self.out / "device_checks.md").write_text(summary(self.data))

    @property
    def failed(self) -> bool:
        return any(s["status"] == "failed" for s in self.data["sections"].values())


def summary(data: dict) -> str:
    lines = ["## Device checks (benchmarks/device_checks.py)", "", f"`{data['command']}`", "",
             "| section | status | seconds | figures |", "|---|---|---|---|"]
    for name, s in data["sections"].items():
        figures = "; ".join(f"{k}: {flat(v)}" for k, v in s["figures"].items())
        lines.append(f"| {name} | {s['status']}{' — ' + s['error'] if s.get('error') else ''} | {s['seconds']} | {figures} |")
    return "\n".join(lines) + "\n"


def flat(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} {flat(v)}" for k, v in value.items()) + "}"
    return str(value)


class Failed(Exception):
    """A check that ran and did not hold (the figures say what was seen)."""


class Context:
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


# ---------------------------------------------------------------------------------------------
def preflight(ctx: Context, figures: dict) -> None:
    import torch
    import torch.distributed as dist

    from ckpt.device import process_group_backend

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
    import torch

    from trainer import model as model_mod

    with torch.device("meta"):
        params = model_mod.num_params(model_mod.build(Job.model_args(ctx)))
    return 16 * params


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_allocated(ctx: Context) -> int | None:
    stats = getattr(ctx.accel, "host_memory_stats", None) if ctx.accel is not None else None
    try:
        return None if stats is None else int(stats().get("allocated_bytes.current", 0))
    except Exception:  # noqa: BLE001 - an allocator without stats
        return None


def pinned(ctx: Context, figures: dict) -> None:
    torch = ctx.torch
    from ckpt.device import empty_host_cache
    from ckpt.write.staging import DoubleBufferStager

    empty_host_cache()
    before = host_allocated(ctx)
    stager = DoubleBufferStager(ctx.device_type)
    state = {"a": torch.randn(3 << 20, device=ctx.device), "b": torch.randn(333, 7, device=ctx.device)}
    staged = stager.stage(state).result()
    segments = [s for b in stager.sets if b.memory for s in b.memory.segments]
    figures["segments_pinned"] = all(s.is_pinned() for s in segments)
    figures["offset_view_pinned"] = staged["b"].is_pinned()
    figures["stager_host_bytes"] = stager.host_bytes
    after = host_allocated(ctx)
    if before is not None and after is not None:
        figures["allocator_allocated_bytes_delta"] = after - before
    stager.close()
    released = host_allocated(ctx)
    if released is not None and before is not None:
        figures["allocator_bytes_after_close_minus_before"] = released - before
    sizes = [1 << 20, 4 << 20, 16 << 20] if ctx.dry else [GIB, 4 * GIB, 16 * GIB]
    for size in sizes:
        if size * 2 > mem_available():
            figures[f"pin_{size >> 20}MiB_s"] = "skipped: not enough free host memory"
            continue
        start = time.perf_counter()
        block = torch.empty(size, dtype=torch.uint8, pin_memory=ctx.accel is not None)
        figures[f"pin_{size >> 20}MiB_s"] = round(time.perf_counter() - start, 4)
        del block
        empty_host_cache()
    if ctx.accel is not None and not (figures["segments_pinned"] and figures["offset_view_pinned"]):
        raise Failed("staging buffers are not pinned")
    if figures.get("allocator_allocated_bytes_delta", figures["stager_host_bytes"]) != figures["stager_host_bytes"]:
        raise Failed("our host_bytes differs from the host allocator's figure")


def ordering(ctx: Context, figures: dict) -> None:
    torch = ctx.torch
    from ckpt.write.staging import DoubleBufferStager

    junit = ctx.work / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "accelerator", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", "tests/ckpt/test_accelerator.py"], cwd=REPO,
                          capture_output=True, text=True, timeout=max(60, min(240, ctx.left())))
    figures["tests"] = junit_outcomes(junit) if junit.exists() else {"pytest": proc.stdout[-500:]}
    # Negative control: without the wait, the next in-place add races the copy and reaches the snapshot.
    n = (1 << 16) if ctx.dry else (1 << 28)  # 1 GiB of fp32 on a device: the copy takes milliseconds
    x = torch.zeros(n, device=ctx.device)
    for waited in (True, False):
        stager = DoubleBufferStager(ctx.device_type)
        stager.stage({"x": x}).result()  # buffers allocated outside the control
        stager.wait_snapshot(host=True)
        x.zero_()
        future = stager.stage({"x": x})
        if waited:
            stager.wait_snapshot()
        x.add_(1.0)
        staged = future.result()["x"]
        stager.wait_snapshot(host=True)
        figures["mismatched_with_wait" if waited else "mismatched_without_wait_control"] = int((staged != 0).sum())
        stager.close()
    figures["control_shows_the_race"] = figures["mismatched_without_wait_control"] > 0
    failed = [name for name, outcome in figures["tests"].items() if outcome == "failed"]
    if proc.returncode not in (0, 5) or failed or figures["mismatched_with_wait"]:
        raise Failed(f"accelerator tests failed: {failed}" if failed else "a waited snapshot saw a later write")


def junit_outcomes(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        outcomes[case.get("name")] = {"failure": "failed", "error": "failed"}.get(kind, kind)
    return outcomes


def dtensor(ctx: Context, figures: dict) -> None:
    torch = ctx.torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckpt.write.staging import DoubleBufferStager

    mesh = init_device_mesh(ctx.device_type, (1,))
    rows = 256 if ctx.dry else 1 << 18  # 1 GiB of fp32 in two DTensors
    state = {"w": distribute_tensor(torch.randn(rows, 512, device=ctx.device), mesh, [Shard(0)]),
             "m": distribute_tensor(torch.randn(rows, 512, device=ctx.device), mesh, [Replicate()])}
    stager = DoubleBufferStager(ctx.device_type)
    stager.stage(state).result()
    stager.wait_snapshot(host=True)
    for t in state.values():
        t.to_local().add_(1.0)  # new values: stale bytes from the warm-up would not match
    ctx.sync()
    figures["state_bytes"] = sum(t.to_local().nbytes for t in state.values())
    if ctx.accel is not None:
        ctx.accel.reset_peak_memory_stats()
        before = ctx.accel.memory_allocated()
    staged = stager.stage(state)
    if ctx.accel is not None:
        figures["device_bytes_allocated_by_stage"] = ctx.accel.memory_allocated() - before
    result = staged.result()
    if ctx.accel is not None:
        figures["device_peak_bytes_over_before"] = ctx.accel.max_memory_allocated() - before
    local = result["w"].to_local()
    figures["staged_device"] = str(local.device)
    figures["staged_pinned"] = local.is_pinned()
    figures["bytes_equal"] = all(torch.equal(result[k].to_local(), state[k].to_local().cpu()) for k in state)
    stager.close()
    if not figures["bytes_equal"] or local.device.type != "cpu":
        raise Failed("a staged DTensor is not the state's bytes on the host")
    if figures.get("device_peak_bytes_over_before", 0) > figures["state_bytes"] // 8:
        raise Failed("staging allocated device memory in the order of the state")


# ---------------------------------------------------------------------------------------------
class Job:
    """The project's llama with AdamW on random tokens; bf16 autocast on the device."""

    def __init__(self, ctx: Context, seed: int = 0):
        torch = ctx.torch
        from trainer import model as model_mod

        self.ctx = ctx
        self.args = self.model_args(ctx)
        self.batch, self.seq = (2, 64) if ctx.dry else (4, 2048)
        torch.manual_seed(seed)
        with torch.device(ctx.device):
            self.model = model_mod.build(self.args)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        tokens = torch.randint(0, self.args.vocab_size, (self.batch, self.seq + 1), device=ctx.device)
        self.inputs, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.params = model_mod.num_params(self.model)

    @staticmethod
    def model_args(ctx: Context):
        from trainer import model as model_mod

        if ctx.dry:
            return model_mod.model_args("debug", max_seq_len=128)
        return model_mod.ModelArgs(dim=2048, n_layers=16, n_heads=16, vocab_size=32000, max_seq_len=2048)

    def forward_backward(self) -> None:
        torch = self.ctx.torch
        with torch.autocast(self.ctx.device_type, dtype=torch.bfloat16, enabled=self.ctx.accel is not None):
            logits = self.model(self.inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), self.labels.flatten())
        loss.backward()

    def step(self) -> None:
        self.forward_backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict:
        return {"model": self.model, "optim": self.opt}

    def timed_step(self, before_optimizer=None) -> float:
        self.ctx.sync()
        start = time.perf_counter()
        self.forward_backward()
        if before_optimizer is not None:
            before_optimizer()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ctx.sync()
        return time.perf_counter() - start


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def overlap(ctx: Context, figures: dict) -> None:
    torch = ctx.torch
    from ckpt.state import export_state
    from ckpt.write.staging import DoubleBufferStager

    job = Job(ctx)
    for _ in range(3):
        job.step()
    plain = median([job.timed_step() for _ in range(3)])
    figures.update(params_millions=round(job.params / 1e6, 1), plain_step_s=round(plain, 4))
    for mode in ("pinned", "pageable", "host-ahead"):
        stager = DoubleBufferStager(ctx.device_type, pin_memory=ctx.accel is not None and mode != "pageable")
        tree, _ = export_state(job.state())
        stager.stage(tree).result()  # the set allocated (pinning is timed in the pinned section)
        stager.wait_snapshot(host=True)
        job.step()
        if mode != "host-ahead":
            ctx.sync()
        tree, _ = export_state(job.state())
        tensors = [t for t in _tensors(tree)]
        reference = [t.detach().clone() for t in tensors]  # on the compute stream: the state at the save
        trace = ctx.work / f"trace-{mode}.json"
        with _profiler(ctx) as prof:
            start = time.perf_counter()
            future = stager.stage(tree)
            staged_at = time.perf_counter() - start
            step_s = job.timed_step(before_optimizer=stager.wait_snapshot)
        staged = [t for t in _tensors(future.result())]
        figures[f"{mode}_stage_call_s"] = round(staged_at, 5)
        figures[f"{mode}_step_lost_s"] = round(step_s - plain, 4)
        figures[f"{mode}_state_equal"] = all(torch.equal(s.to_local() if hasattr(s, "to_local") else s, r.cpu())
                                             for s, r in zip(staged, reference))
        if prof is not None:
            prof.export_chrome_trace(str(trace))
            figures[f"{mode}_copy_overlapped_fraction"] = copy_overlap(trace)
            if mode == "pinned":
                with open(trace, "rb") as src, gzip.open(ctx.out / "trace-pinned.json.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
        del reference
        stager.close()
        if not figures[f"{mode}_state_equal"]:
            raise Failed(f"{mode}: the snapshot differs from the state at the save")


def _tensors(tree):
    from ckpt.tree import leaves

    return [v for v in leaves(tree) if hasattr(v, "shape") and hasattr(v, "dtype")]


class _NoProfiler:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _profiler(ctx: Context):
    if ctx.device_type != "cuda":
        return _NoProfiler()
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


class OursSaver:
    """ckpt.CheckpointManager: pinned double buffer, side-stream copy, the wait in the optimizer pre-hook."""

    def __init__(self, ctx: Context, job: Job, root: Path):
        import ckpt

        self.manager = ckpt.CheckpointManager(root, interval=1, keep=1, device_type=ctx.device_type)
        self.manager.attach(job.opt)
        self.job = job

    def save(self, step: int) -> None:
        self.manager.save(step, self.job.state(), force=True)

    before_optimizer = None  # the manager's own optimizer pre-hook waits

    def drain(self) -> None:
        self.manager.wait()

    def close(self, entry: dict) -> None:
        entry["device_stall_ms_total"] = round(1e3 * self.manager.stats.device_stall_s, 2)
        entry["host_buffer_gib"] = round(self.manager.stats.host_buffer_bytes / GIB, 2)
        self.manager.close()


class DCPSaver:
    """``dcp.async_save`` with DCP's pinned ``DefaultStager`` (torchtitan's async_with_pinned_mem) or
    its default (the writer stages); waits for staging before the optimizer step, one save in flight."""

    def __init__(self, ctx: Context, job: Job, root: Path, pinned: bool):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.job, self.root = job, root
        self.stager = DefaultStager(StagingOptions(True, False, True, True)) if pinned else None
        self.staging = self.upload = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.drain()
        model_sd, optim_sd = get_state_dict(self.job.model, self.job.opt)
        response = dcp.async_save({"model": model_sd, "optim": optim_sd}, async_stager=self.stager,
                                  storage_writer=dcp.FileSystemWriter(self.root / f"step-{step}"))
        self.staging = getattr(response, "staging_completion", None)
        self.upload = getattr(response, "upload_completion", response)

    def before_optimizer(self) -> None:
        if self.staging is not None:
            self.staging, staging = None, self.staging
            staging.result()

    def drain(self) -> None:
        self.before_optimizer()
        if self.upload is not None:
            self.upload, upload = None, self.upload
            upload.result()

    def close(self, entry: dict) -> None:
        self.drain()
        if self.stager is not None:
            self.stager.close()


def stall(ctx: Context, figures: dict) -> None:
    job = Job(ctx)
    for _ in range(3):
        job.step()
    every, saves = ctx.args.every, (2 if ctx.dry else 3)
    figures["every"] = every
    systems = {"ours": lambda root: OursSaver(ctx, job, root),
               "dcp-pinned": lambda root: DCPSaver(ctx, job, root, pinned=True),
               "dcp-default": lambda root: DCPSaver(ctx, job, root, pinned=False)}
    if ctx.accel is None:
        del systems["dcp-pinned"]  # its pinned, non-blocking options need an accelerator
    for system, make in systems.items():
        if ctx.left() < 30:
            figures[system] = "skipped: budget"
            continue
        root = ctx.work / f"stall-{system}"
        shutil.rmtree(root, ignore_errors=True)
        saver = make(root)
        plain = median([job.timed_step() for _ in range(3)])
        calls, lost = [], []
        for n in range(saves + 1):  # the first save allocates its buffers: reported apart
            ctx.sync()
            start = time.perf_counter()
            saver.save(n + 1)
            calls.append(time.perf_counter() - start)
            lost.append(calls[-1] + job.timed_step(before_optimizer=saver.before_optimizer) - plain)
            if n == 0:
                saver.drain()
            for _ in range(every - 1):
                job.step()
        saver.drain()
        entry = {"plain_step_s": round(plain, 4), "first_save_lost_s": round(lost[0], 4),
                 "save_call_ms": round(1e3 * median(calls[1:]), 2), "step_lost_ms": round(1e3 * median(lost[1:]), 2)}
        saver.close(entry)
        figures[system] = entry
        shutil.rmtree(root, ignore_errors=True)


def trainer(ctx: Context, figures: dict) -> None:
    base = ctx.work / "trainer"
    shutil.rmtree(base, ignore_errors=True)
    cut, end = (10, 20) if ctx.dry else (40, 60)
    common = [sys.executable, "-m", "trainer.train", "--config", "configs/debug.toml", "--training.device",
              ctx.device_type, "--checkpoint.interval", str(cut // 2), "--metrics.log_freq", "1"]

    def run(folder: Path, steps: int) -> subprocess.CompletedProcess:
        return subprocess.run(common + ["--training.steps", str(steps), "--job.dump_folder", str(folder)], cwd=REPO,
                              capture_output=True, text=True, timeout=max(60, min(240, ctx.left())))

    first, resumed, straight = run(base / "resumed", cut), run(base / "resumed", end), run(base / "straight", end)
    figures["exit_codes"] = [first.returncode, resumed.returncode, straight.returncode]
    if any(figures["exit_codes"]):
        bad = next(p for p in (first, resumed, straight) if p.returncode)
        raise Failed(f"a trainer run exited {bad.returncode}: {' '.join(bad.stderr.strip().splitlines()[-1:])}")
    losses = {name: {r["step"]: r["loss"] for r in map(json.loads, (base / name / "metrics.jsonl").read_text().splitlines())
                     if "loss" in r} for name in ("resumed", "straight")}
    after = [s for s in losses["straight"] if s > cut]
    diffs = [abs(losses["resumed"][s] - losses["straight"][s]) for s in after if s in losses["resumed"]]
    figures["steps_compared"] = len(diffs)
    figures["max_abs_loss_diff_after_resume"] = max(diffs) if diffs else None
    figures["last_loss"] = losses["resumed"].get(end)
    if len(diffs) != len(after) or not diffs:
        raise Failed("the resumed run did not log the steps after the resume")
    if ctx.device_type == "cpu" and max(diffs) != 0.0:
        raise Failed("on CPU the resumed losses must equal the uninterrupted run's")


CHECKS = {"preflight": preflight, "pinned": pinned, "ordering": ordering, "dtensor": dtensor,
          "overlap": overlap, "stall": stall, "trainer": trainer}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (what CI runs)")
    p.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)} (preflight always runs)")
    p.add_argument("--device", default="auto", help="auto (default), cuda or npu")
    p.add_argument("--out", default=None, help="results folder (default: $OUT, else benchmarks/_work/device_checks)")
    p.add_argument("--work", default=None, help="scratch folder for checkpoints (default: /dev/shm on a device)")
    p.add_argument("--budget", type=float, default=360.0, help="seconds; later sections are skipped past it")
    p.add_argument("--every", type=int, default=30, help="steps between saves in the stall section")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    out = Path(args.out or os.environ.get("OUT") or REPO / "benchmarks" / "_work" / "device_checks")
    wanted = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        print(f"device_checks: unknown sections {sorted(unknown)}; expected {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    results = Results(out, argv)
    signal.signal(signal.SIGTERM, lambda *_: (results.write(), os._exit(143)))
    sys.path.insert(0, str(REPO))
    missing = install_missing_wheels()
    try:
        import ckpt  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the one reason the rest cannot run
        results.record("preflight", "failed", 0.0, {"missing_before_wheels": missing}, f"import ckpt: {exc}")
        print(f"device_checks: import ckpt failed: {exc}", file=sys.stderr)
        return 3
    ctx = Context(args)
    ctx.out = out
    for name in SECTIONS:
        if name != "preflight" and name not in wanted:
            continue
        if name != "preflight" and ctx.left() < 0:
            results.record(name, "skipped", 0.0, {}, "time budget spent")
            continue
        start, figures = time.perf_counter(), {}
        if name == "preflight" and missing:
            figures["installed_from_wheels"] = missing
        try:
            CHECKS[name](ctx, figures)
            results.record(name, "ok", time.perf_counter() - start, figures)
        except Failed as exc:  # what was measured up to the failure is kept
            results.record(name, "failed", time.perf_counter() - start, figures, str(exc))
        except Exception as exc:  # noqa: BLE001 - one section's crash must not lose the others
            traceback.print_exc()
            results.record(name, "failed", time.perf_counter() - start, figures, f"{type(exc).__name__}: {exc}")
        print(f"device_checks: {name}: {results.data['sections'][name]['status']} "
              f"({results.data['sections'][name]['seconds']} s)", flush=True)
    print(summary(results.data))
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())

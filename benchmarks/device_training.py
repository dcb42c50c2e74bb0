"""The training sections of ``device_checks.py``: snapshots of a real job on the device, and the trainer.

* :class:`Job`: the project's llama (~1B parameters on a device, the debug one in a dry run) with
  AdamW on random tokens, bf16 autocast on the device; a step, optionally timed.
* :func:`overlap`: one snapshot each with pinned buffers, pageable buffers and with the host ahead
  of the device (no synchronize before the save): the step time lost, the copy/compute overlap from
  a profiler trace (:func:`copy_overlap`), the staged state against a device clone taken at the save.
* :func:`stall`: per save, ours (:class:`OursSaver`: the manager, pinned double buffer, side stream)
  against DCP ``async_save`` (:class:`DCPSaver`, through ``peers.DCPAsyncSave``) with its pinned
  stager and its default: host time in the save, step time lost, the first (allocating) save apart.
* :func:`trainer`: ``python -m trainer.train`` on the device: a run with checkpoints, its resume,
  an uninterrupted run; the losses after the resume against the uninterrupted run's.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from device_setup import GIB, REPO, Context, Failed
from harness import median


def job_model_args(ctx: Context):
    """The job's model: ~1B parameters on a device (dim 2048, 16 layers, 32k vocabulary), the debug
    llama in a dry run."""
    from trainer import model as model_mod

    if ctx.dry:
        return model_mod.model_args("debug", max_seq_len=128)
    return model_mod.ModelArgs(dim=2048, n_layers=16, n_heads=16, vocab_size=32000, max_seq_len=2048)


class Job:
    """The project's llama with AdamW on random tokens; bf16 autocast on the device."""

    def __init__(self, ctx: Context, seed: int = 0):
        torch = ctx.torch
        from trainer import model as model_mod

        self.ctx = ctx
        self.args = job_model_args(ctx)
        self.batch, self.seq = (2, 64) if ctx.dry else (4, 2048)
        torch.manual_seed(seed)
        with torch.device(ctx.device):
            self.model = model_mod.build(self.args)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        tokens = torch.randint(0, self.args.vocab_size, (self.batch, self.seq + 1), device=ctx.device)
        self.inputs, self.labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        self.params = model_mod.num_params(self.model)

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



def overlap(ctx: Context, figures: dict) -> None:
    torch = ctx.torch
    from ckpt import DoubleBufferStager
    from ckpt.state import export_state

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
        tensors = [t for t in tensor_leaves(tree)]
        reference = [t.detach().clone() for t in tensors]  # on the compute stream: the state at the save
        trace = ctx.work / f"trace-{mode}.json"
        with profiler(ctx) as prof:
            start = time.perf_counter()
            future = stager.stage(tree)
            staged_at = time.perf_counter() - start
            step_s = job.timed_step(before_optimizer=stager.wait_snapshot)
        staged = [t for t in tensor_leaves(future.result())]
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


def tensor_leaves(tree):
    from ckpt.tree import leaves

    return [v for v in leaves(tree) if hasattr(v, "shape") and hasattr(v, "dtype")]


def profiler(ctx: Context):
    if ctx.device_type != "cuda":
        return contextlib.nullcontext()
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
    """``dcp.async_save`` through ``peers.DCPAsyncSave`` (one save in flight) with DCP's pinned
    ``DefaultStager`` (torchtitan's async_with_pinned_mem) or its default (the writer stages); waits
    for staging before the optimizer step."""

    def __init__(self, job: Job, root: Path, stager: str):
        import peers

        self.job, self.root = job, root
        self.peer = peers.DCPAsyncSave(stager, no_dist=False)  # over the process group of the preflight

    def save(self, step: int) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.peer.drain()
        model_sd, optim_sd = get_state_dict(self.job.model, self.job.opt)
        self.peer.save({"model": model_sd, "optim": optim_sd}, self.root / f"step-{step}")

    def before_optimizer(self) -> None:
        self.peer.wait_staged()

    def drain(self) -> None:
        self.peer.drain()

    def close(self, entry: dict) -> None:
        self.peer.drain()
        self.peer.close()


def stall(ctx: Context, figures: dict) -> None:
    job = Job(ctx)
    for _ in range(3):
        job.step()
    every, saves = ctx.args.every, (2 if ctx.dry else 3)
    figures["every"] = every
    systems = {"ours": lambda root: OursSaver(ctx, job, root),
               "dcp-pinned": lambda root: DCPSaver(job, root, "pinned"),
               "dcp-default": lambda root: DCPSaver(job, root, "default")}
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


"""What ``bench_layouts.py`` runs inside its ranks: one trainer run, one minimal FSDP2 loop, and a
plan of them (every row once per repeat, the order rotated) on every rank of one world size.

* :func:`run_trainer`: ``Trainer(load_config(argv))``, ``fit()``, ``close()``; tokens/s over the
  steps after the warm-up from rank 0's ``metrics.jsonl`` (``trainer_log``), and with checkpointing
  the stall per save twice: the manager's ``stats.stall_s`` and the logged ``ckpt_stall_ms``.
* :func:`run_minimal`: the trainer's model, data and hyper-parameters under FSDP2 by hand (or
  unwrapped in one process: the reference), forward/backward/clip/step per step, nothing else.
* :func:`run_plan`: ``run_ranks``' function: the untimed warm-up round, then the repeats; rank 0
  returns every row's results per repeat.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness import rotated  # first: puts this checkout's root on sys.path

from trainer import data as data_mod  # noqa: E402
from trainer import model as model_mod  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.optim import lr_lambda  # noqa: E402
from trainer.train import Trainer  # noqa: E402
from trainer_log import logged_window  # noqa: E402

BASE_CONFIG = "configs/debug.toml"
LOG_FREQ = 5
CKPT_INTERVAL = 10


def trainer_argv(steps: int, dump: Path, flags: list[str]) -> list[str]:
    return ["--config", BASE_CONFIG, "--training.steps", str(steps), "--training.device", "cpu",
            "--metrics.log_freq", str(LOG_FREQ), "--checkpoint.enable", "false", "--job.dump_folder", str(dump),
            *flags]


def run_trainer(flags: list[str], steps: int, warmup: int, dump: Path) -> dict:
    start = time.perf_counter()
    tr = Trainer(load_config(trainer_argv(steps, dump, flags)))
    setup = time.perf_counter() - start
    stalls: list[float] = []  # manager.stats.stall_s at the start of each step (the ckpt row)
    if tr.manager is not None:
        inner = tr.train_step

        def marked_step():
            stalls.append(tr.manager.stats.stall_s)
            return inner()

        tr.train_step = marked_step
    try:
        losses = tr.fit()
        if tr.manager is not None:
            stalls.append(tr.manager.stats.stall_s)  # after the final step's save(), before close()
    finally:
        tr.close()
    out = {"setup_s": setup, "losses": losses}
    if dist.get_rank() == 0:
        t = tr.cfg.training
        window = logged_window(dump, warmup, t.batch_size * t.seq_len)
        out["tps"], out["window_s"] = window.tokens_per_s, window.seconds
        saves = sum(1 for s in range(warmup + 1, steps + 1) if s % CKPT_INTERVAL == 0 or s == steps)  # + final
        out["stall_ms_per_save"] = out["manager_stall_ms_per_save"] = None
        if tr.manager is not None and saves:
            out["stall_ms_per_save"] = window.per_step_sum("ckpt_stall_ms") / saves  # as metrics.jsonl reports it
            # the manager's own count over the same steps: save() + the snapshot waits in the
            # optimizer pre-hook (of the first window step, for the save that ended the warm-up, too)
            out["manager_stall_ms_per_save"] = 1e3 * (stalls[-1] - stalls[warmup]) / saves
    return out


def run_minimal(steps: int, warmup: int, sharded: bool = True) -> dict:
    """Plain FSDP2 over all ranks: the trainer's model, data and hyper-parameters, nothing else.
    ``sharded=False``: the unwrapped model on the whole batch in this one process (the reference)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    start = time.perf_counter()
    cfg = load_config(trainer_argv(steps, Path("unused"), []))
    t = cfg.training
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    tokenizer, tokens = data_mod.load_training_tokens(cfg.model.tokenizer, t.dataset, t.seq_len)
    torch.manual_seed(cfg.job.seed)
    model = model_mod.build(cfg.model_args(tokenizer.vocab_size))
    if sharded:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.warmup_steps, t.steps, t.min_lr_ratio))
    loader = data_mod.DataLoader(tokens, t.seq_len, t.batch_size, rank, world, cfg.job.seed)
    setup = time.perf_counter() - start
    marks, losses = [], []
    for _ in range(steps):
        marks.append(time.perf_counter())
        inputs, labels = loader.next_batch()
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    marks.append(time.perf_counter())
    mean = torch.stack(losses)  # outside the timing: the data-parallel mean, as the trainer reports it
    if sharded:
        dist.all_reduce(mean)
    window = marks[steps] - marks[warmup]
    return {"setup_s": setup, "losses": (mean / world).tolist(), "window_s": window,
            "tps": (steps - warmup) * t.batch_size * t.seq_len / window, "stall_ms_per_save": None}


def run_row(key: str, flags, steps: int, warmup: int, dump: Path) -> dict:
    """One row's run on every rank, between two barriers; its dump folder removed afterwards."""
    rank = dist.get_rank()
    dist.barrier()
    try:
        if key == "single":  # rank 0 alone; the others wait in the barrier below (blocked, not spinning)
            cpu = time.process_time()
            r = run_minimal(steps, warmup, sharded=False) if rank == 0 else {}
            idle = torch.tensor([0.0 if rank == 0 else time.process_time() - cpu])
            dist.all_reduce(idle, op=dist.ReduceOp.MAX)  # the busiest waiting rank's CPU seconds
            r["idle_rank_cpu_s"] = idle.item()
            return r
        if flags is None:
            return run_minimal(steps, warmup)
        return run_trainer(flags, steps, warmup, dump)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(dump, ignore_errors=True)


def run_plan(rank: int, world: int, plan: dict) -> dict | None:
    """Every row of ``plan["variants"]`` once per repeat on this rank (after an untimed warm-up round
    of 3 steps each, unless left out); rank 0 returns ``{key: [result per repeat]}``."""
    work = Path(plan["work"])
    results: dict[str, list[dict]] = {}
    if plan["warmup_round"]:  # untimed: first-call costs of every code path in these processes
        for key, _, flags in plan["variants"]:
            start = time.perf_counter()
            run_row(key, flags, 3, 0, work / f"{key}-warmup")
            if rank == 0:
                print(f"[{world} ranks] untimed warm-up {key}: {time.perf_counter() - start:.1f}s", flush=True)
    for rep in range(plan["repeats"]):
        for key, name, flags in rotated(plan["variants"], rep):
            r = run_row(key, flags, plan["steps"], plan["warmup"], work / f"{key}-r{rep}")
            results.setdefault(key, []).append(r)
            if rank == 0:
                stall = (f"  stall {r['stall_ms_per_save']:.1f} ms/save (manager {r['manager_stall_ms_per_save']:.1f})"
                         if r.get("stall_ms_per_save") is not None else "")
                print(f"[{world} ranks {rep + 1}/{plan['repeats']}] {name:34s} {r['tps']:8.0f} tok/s  "
                      f"window {r['window_s']:6.2f}s  setup {r['setup_s']:5.2f}s{stall}  "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    return results if rank == 0 else None

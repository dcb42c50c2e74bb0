"""The training loop: llama pretraining with data parallelism and built-in, resumable checkpoints.

    torchrun --nproc_per_node 2 -m trainer.train --config configs/debug.toml [--section.key value ...]
    python -m trainer.train --config configs/debug.toml          # one process

Each step: ``gradient_accumulation_steps`` micro-batches forward/backward (gradient sync on the
last), clip, AdamW, warmup+cosine LR, then ``CheckpointManager.save`` (asynchronous: the training
thread only waits for the snapshot copy right before the next optimizer step). A run with
checkpointing resumes from the latest committed step (or ``--checkpoint.load_step``); the data
loader's global position is in the checkpoint, so the resumed run sees exactly the batches it would
have seen, also with another data-parallel degree.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ckpt
from trainer import data as data_mod
from trainer import model as model_mod
from trainer.config import Config, ConfigError, help_text, load_config
from trainer.device import DeviceUnavailableError, device_name, init_distributed, peak_memory_gib, resolve_device_type, synchronize
from trainer.metrics import MetricsLogger, peak_flops
from trainer.parallel import (ParallelDims, ParallelismError, all_reduce_mean, dp_rank, parallelize, set_gradient_sync,
                              uses_autocast)


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:  # ``step`` = optimizer steps taken so far
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class TrainState:
    """The loop's own counters, checkpointed with the model."""

    def __init__(self):
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])


@contextlib.contextmanager
def scheduled_garbage_collection(gc_freq: int):
    """Automatic collection off for the block; ``collect(step)`` runs generations 0-1 every
    ``gc_freq`` steps. Restores the interpreter's previous setting on exit."""
    if gc_freq <= 0:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect(1)
    try:
        yield lambda step: gc.collect(1) if step % gc_freq == 0 else None
    finally:
        if was_enabled:
            gc.enable()


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device_type = resolve_device_type(cfg.training.device)
        self.rank, self.world, self.device, self._owns_process_group = init_distributed(self.device_type)
        p = cfg.parallelism
        self.dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.tp, p.pp, self.world)
        self.mesh = self.dims.build_mesh(self.device_type)
        self.dp_rank = dp_rank(self.mesh, self.dims)
        self.micro_batch, self.accumulation = cfg.resolve_batch(self.dims.dp)
        torch.manual_seed(cfg.job.seed)

        self.tokenizer = data_mod.load_tokenizer(cfg.model.tokenizer)
        m = cfg.model
        self.model_args = model_mod.model_args(
            m.flavor, vocab_size=m.vocab_size or self.tokenizer.vocab_size, dim=m.hidden_dim,
            n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
            max_seq_len=max(cfg.training.seq_len, model_mod.FLAVORS[m.flavor.lower()].max_seq_len))
        model = model_mod.build(self.model_args)
        self.bf16 = cfg.optimization.precision == "bf16"
        model = model.to(self.device)
        self.model = parallelize(
            model, self.dims, self.mesh, zero_stage=cfg.optimization.zero_stage, bf16=self.bf16,
            activation_checkpointing=cfg.optimization.gradient_checkpointing,
            compile=cfg.optimization.compile, device=self.device)
        self.autocast_bf16 = self.bf16 and uses_autocast(self.model)
        t = cfg.training
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(0.9, 0.95),
                                           weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.warmup_steps, t.steps, t.min_lr_ratio))
        tokens = data_mod.TokenStream(data_mod.load_documents(t.dataset), self.tokenizer).tokens
        self.loader = data_mod.DataLoader(tokens, t.seq_len, t.batch_size, self.dp_rank, self.dims.dp, cfg.job.seed)
        self.train_state = TrainState()
        self.state = {"model": self.model, "optim": self.optimizer, "lr_scheduler": self.scheduler,
                      "dataloader": self.loader, "train": self.train_state}
        self.flops_per_token = model_mod.flops_per_token(self.model_args, t.seq_len)
        self.peak = peak_flops(device_name(self.device_type))
        self.metrics = MetricsLogger(cfg.job.dump_folder, enabled=self.rank == 0, tensorboard=cfg.metrics.tensorboard)
        if self.rank == 0:
            (Path(cfg.job.dump_folder) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        self.manager = None
        c = cfg.checkpoint
        if c.enable or c.create_seed_checkpoint:
            folder = Path(c.folder) if os.path.isabs(c.folder) else Path(cfg.job.dump_folder) / c.folder
            self.manager = ckpt.CheckpointManager(
                folder, c.save_options(device_type=self.device_type, user_metadata={"config": cfg.to_dict()}))
            self.manager.attach(self.optimizer)

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def resume(self) -> None:
        if self.manager is None:
            return
        step = self.manager.load(self.state, step=self.cfg.checkpoint.load_step)
        if step is not None:
            self.log(f"resumed from checkpoint step {step} ({self.manager.root})")

    def train_step(self) -> torch.Tensor:
        inputs, labels = self.loader.next_batch()
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        total = torch.zeros((), device=self.device)
        autocast = torch.autocast(self.device_type, dtype=torch.bfloat16,
                                  enabled=self.autocast_bf16)
        for micro in range(self.accumulation):
            chunk = slice(micro * self.micro_batch, (micro + 1) * self.micro_batch)
            with set_gradient_sync(self.model, micro == self.accumulation - 1), autocast:
                logits = self.model(inputs[chunk])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels[chunk].flatten())
                (loss / self.accumulation).backward()
            total += loss.detach() / self.accumulation
        if self.cfg.training.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def fit(self, stop_at: int | None = None) -> list[float]:
        """Train to ``training.steps`` (or stop after step ``stop_at``, as if interrupted); returns
        the data-parallel mean loss of every step run."""
        cfg, t = self.cfg, self.cfg.training
        if cfg.checkpoint.create_seed_checkpoint:
            self.manager.save(0, self.state, force=True)
            self.manager.close()
            self.log(f"seed checkpoint written to {self.manager.root / 'step-00000000'}")
            return []
        self.resume()
        last = t.steps if stop_at is None else min(stop_at, t.steps)
        with scheduled_garbage_collection(t.gc_freq) as collect_garbage:
            return self._train_until(last, collect_garbage)

    def _train_until(self, last: int, collect_garbage) -> list[float]:
        cfg, t = self.cfg, self.cfg.training
        losses = []
        tokens_per_step = t.batch_size * t.seq_len
        window_start, window_steps, stall = time.perf_counter(), 0, 0.0
        while self.train_state.step < last:
            self.train_state.step += 1
            step = self.train_state.step
            loss = self.train_step()
            self.train_state.tokens_seen += tokens_per_step
            if self.manager is not None:
                before = self.manager.stats.stall_s
                self.manager.save(step, self.state, force=step == t.steps)
            losses.append(all_reduce_mean(loss))
            window_steps += 1
            if self.manager is not None:
                stall += self.manager.stats.stall_s - before
            if step % cfg.metrics.log_freq == 0 or step == t.steps:
                synchronize(self.device_type)
                elapsed = time.perf_counter() - window_start
                tps = window_steps * tokens_per_step / elapsed
                self.metrics.log({
                    "step": step,
                    "loss": losses[-1],
                    "lr": self.scheduler.get_last_lr()[0],
                    "tokens_per_sec": tps,
                    "tokens_per_sec_per_device": tps / self.world,
                    "mfu_pct": None if self.peak is None else 100 * self.flops_per_token * tps / self.world / self.peak,
                    "memory_gib": peak_memory_gib(self.device_type),
                    "ckpt_stall_ms": 1e3 * stall / window_steps,
                })
                window_start, window_steps, stall = time.perf_counter(), 0, 0.0
            collect_garbage(step)
        return losses

    def close(self) -> None:
        try:
            if self.manager is not None:
                self.manager.close()
        finally:
            self.metrics.close()
            if self._owns_process_group and dist.is_initialized():
                dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)
        trainer = Trainer(cfg)
    except (ConfigError, ParallelismError, ckpt.CheckpointError, DeviceUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    try:
        trainer.log(f"training {cfg.model.name}/{cfg.model.flavor} ({model_mod.num_params(trainer.model):,} params "
                    f"on this rank) on {trainer.world} x {trainer.device_type}, dp={trainer.dims.dp}, "
                    f"micro_batch={trainer.micro_batch}, accumulation={trainer.accumulation}")
        trainer.fit()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

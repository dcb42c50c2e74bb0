"""The training loop: llama pretraining with data parallelism and built-in, resumable checkpoints.

    torchrun --nproc_per_node 2 -m trainer.train --config configs/debug.toml [--section.key value ...]
    python -m trainer.train --config configs/debug.toml          # one process
    python -m trainer.train --config FILE --dry-run [--measure]  # the memory plan (trainer.plan), and
                                                                 # one step measured (trainer.measure)

Each step: ``gradient_accumulation_steps`` micro-batches forward/backward (gradient sync on the
last), clip, AdamW, warmup+cosine LR, then ``CheckpointManager.save`` (asynchronous: the training
thread only waits for the snapshot copy right before the next optimizer step). A run with
checkpointing resumes from the latest committed step (or ``--checkpoint.load_step``); the data
loader's global position is in the checkpoint, so the resumed run sees exactly the batches it would
have seen, also with another data-parallel degree.

Exit codes (an expected failure prints exactly one ``error: ...`` line on stderr, no traceback):

    0  done: trained to training.steps, or wrote the seed checkpoint, or nothing to train: the checkpoint
       resumed is already at or past training.steps (one line says so; nothing is written)
    1  failed: the checkpoint to resume from (or initial_load_path) cannot be loaded, or a save failed under
       checkpoint.on_error=stop; committed checkpoints stay and a restart resumes from the newest
    2  refused before training, nothing written: a config that cannot work (keys, values, model shapes,
       vocab_size below the tokenizer's, dataset or tokenizer missing/empty/unreadable, layout vs world
       size), a checkpoint folder another run holds or that cannot be created, a load_step not committed,
       a checkpoint.initial_load_path holding no checkpoint or model weights that do not fit the model,
       a load_step older than the newest committed step without checkpoint.branch
  143  stopped by SIGTERM (130: SIGINT) after a step every rank agreed on: the in-flight save finished,
       with checkpoint.save_on_signal that step was saved, the last line names the newest committed step
"""

from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist

import ckpt
from ckpt.redact import redact
from . import data as data_mod
from . import exits
from . import model as model_mod
from .checkpointing import RunCheckpoints
from .config import Config, help_text, load_config
from .device import device_name, init_distributed, peak_memory_gib, resolve_device_type, synchronize
from .metrics import MetricsLogger, StepWindow, peak_flops
from .scaler import ShardedGradScaler
from . import optim as optim_mod
from . import step as step_mod
from . import run_lines
from .assembly import assemble
from .gc_schedule import scheduled_garbage_collection
from .parallel import ParallelDims, all_reduce_mean, dp_rank
from .run_record import new_run_id, run_end, run_start, write_config
from .signals import Stopped, StopSignals
from .threads import set_torch_threads


class TrainState:
    """The loop's own counters, checkpointed with the model."""

    def __init__(self):
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])


class Trainer:
    """One run. The constructor refuses what cannot work before writing anything: the config and
    data first, then (with the process group) layout and model, then the checkpoint folder's lock,
    then the resume (:mod:`trainer.checkpointing`); only then, unless :attr:`nothing_to_train`, does
    it write config.json and open metrics.jsonl. ``manager`` is the run's :class:`ckpt.CheckpointManager`
    (None without checkpointing)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.checkpoints, self.manager, self.metrics, self._owns_process_group = None, None, None, False
        self.losses: list[float] = []  # the data-parallel mean loss of every step this run trained
        self.grad_norm: torch.Tensor | None = None  # the last step's, on the device (trainer.step)
        self.started = time.perf_counter()
        self.run_id = new_run_id()  # this start of the trainer (trainer.run_record)
        try:
            self._start()
        except BaseException:
            self.close(quiet=True)
            raise

    def _start(self) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.tokenizer, tokens = data_mod.load_training_tokens(cfg.model.tokenizer, t.dataset, t.seq_len)
        self.model_args = cfg.model_args(self.tokenizer.vocab_size)
        with exits.refusing(f"training.device={t.device!r}"):
            self.device_type = resolve_device_type(t.device)
        self.rank, self.world, self.device, self._owns_process_group = init_distributed(self.device_type)
        p = cfg.parallelism
        self.dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.tp, p.pp, self.world, cp=p.cp)
        self.mesh = self.dims.build_mesh(self.device_type)
        self.dp_rank = dp_rank(self.mesh, self.dims)
        self.micro_batch, self.accumulation = cfg.resolve_batch(self.dims.dp)
        torch.manual_seed(cfg.job.seed)

        o = cfg.optimization
        model = model_mod.build(self.model_args).to(self.device)
        run = assemble(cfg, model, self.dims, self.mesh, self.device, micro_batch=self.micro_batch,
                       accumulation=self.accumulation)
        self.model, self.pipeline, self.run = run.model, run.pipeline, run
        self.low_dtype, self.autocast = run.low_dtype, run.autocast
        self.scaler = ShardedGradScaler() if cfg.optimization.precision == "fp16" else None
        self.optimizer = optim_mod.build(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay,
                                         state_dtype=o.optimizer_state_dtype, param_dtype=run.param_dtype,
                                         seed=cfg.job.seed, rank=self.rank)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, optim_mod.lr_lambda(t.warmup_steps, t.steps, t.min_lr_ratio))
        self.loader = data_mod.DataLoader(tokens, t.seq_len, t.batch_size, self.dp_rank, self.dims.dp, cfg.job.seed,
                                          cp_rank=self.mesh.get_local_rank("cp"), cp_degree=self.dims.cp)
        self.train_state = TrainState()
        self.state = {"model": self.model, "optim": self.optimizer, "lr_scheduler": self.scheduler,
                      "dataloader": self.loader, "train": self.train_state}
        if self.scaler is not None:
            self.state["scaler"] = self.scaler
        self.flops_per_token = model_mod.flops_per_token(self.model_args, t.seq_len)
        self.peak = peak_flops(device_name(self.device_type))
        # the lock first: a second run is refused before it writes
        self.checkpoints = RunCheckpoints(cfg, device_type=self.device_type, optimizer=self.optimizer,
                                          model=self.model, log=self.log)
        self.manager = self.checkpoints.manager
        self.checkpoints.start(self.state, self.model)
        if self.checkpoints.resumed_step is not None and (line := run_lines.resumed_lr(t.lr, self.scheduler)):
            self.log(line)
        writes = self.rank == 0 and self.nothing_to_train is None  # a run with nothing to train writes nothing
        with exits.refusing(f"job.dump_folder={cfg.job.dump_folder!r}"):
            self.metrics = MetricsLogger(cfg.job.dump_folder, enabled=writes, tensorboard=cfg.metrics.tensorboard)
            if writes:
                write_config(cfg.job.dump_folder, cfg.to_record(), self.log)
        self.metrics.record(run_start(self.run_id, cfg.to_record(), resumed_step=self.checkpoints.resumed_step,
                                      resumed_from=self.manager and self.manager.loaded_from, world_size=self.world))
        if self.checkpoints.events is not None:
            self.checkpoints.events.send_to(self.metrics.record)

    @property
    def nothing_to_train(self) -> str | None:
        """The line saying so when the checkpoint resumed is already at or past ``training.steps``."""
        if self.cfg.checkpoint.create_seed_checkpoint:
            return None
        return run_lines.nothing_to_train(self.checkpoints.resumed_step, self.cfg.training.steps)

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(redact(message), flush=True)  # a URL's credentials never in a line (issue 22, item 5)

    def train_step(self) -> torch.Tensor:
        """One step (:mod:`trainer.step`): the micro-steps' forward/backward, clip, AdamW; the mean loss.
        Sets ``data_s`` (the seconds spent getting the batch to the device) and ``grad_norm``."""
        started = time.perf_counter()
        inputs, labels = self.loader.next_batch()
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        self.data_s = time.perf_counter() - started
        autocast = torch.autocast(self.device_type, dtype=self.low_dtype or torch.bfloat16, enabled=self.autocast)
        total = step_mod.forward_backward(
            self.model, inputs, labels, pipeline=self.pipeline, micro_batch=self.micro_batch,
            accumulation=self.accumulation, sync_every_micro_step=self.run.sync_every_micro_step,
            loss_parallel=self.run.loss_parallel, autocast=autocast,
            scale=1.0 if self.scaler is None else self.scaler.scale, after_backward=self.run.after_backward)
        self.grad_norm = step_mod.optimizer_step(list(self.model.parameters()), self.optimizer, self.scheduler,
                                max_norm=self.cfg.training.max_norm, scaler=self.scaler,
                                pp_group=self.mesh["pp"].get_group() if self.pipeline is not None else None,
                                clip_grad_norm=self.run.clip_grad_norm)
        return total

    def fit(self, stop_at: int | None = None) -> list[float]:
        """Train to ``training.steps`` (or stop after step ``stop_at``, as if interrupted); returns
        the data-parallel mean loss of every step this call ran (``losses`` holds the run's)."""
        cfg, t = self.cfg, self.cfg.training
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpoints.write_seed(self.state)
            return []
        last = t.steps if stop_at is None else min(stop_at, t.steps)
        with scheduled_garbage_collection(t.gc_freq) as collect_garbage, StopSignals() as signals:
            return self._train_until(last, collect_garbage, signals)

    def _train_until(self, last: int, collect_garbage, signals: StopSignals) -> list[float]:
        cfg, t = self.cfg, self.cfg.training
        losses, first = self.losses, len(self.losses)
        tokens_per_step = t.batch_size * t.seq_len
        window = StepWindow()
        while self.train_state.step < last:
            self.train_state.step += 1
            step = self.train_state.step
            # The stall of a step: the wait for the last snapshot (inside the optimizer step's
            # pre-hook) and the time inside save().
            before = self.checkpoints.stall_s
            loss = self.train_step()
            self.train_state.tokens_seen += tokens_per_step
            failure = self.checkpoints.save(step, self.state, force=step == t.steps)
            waited = time.perf_counter()
            if step == t.steps and failure is None:  # the final save counted in its own metrics record
                failure = self.checkpoints.finish()
            waited = time.perf_counter() - waited
            # The mean loss, "did a save fail on any rank?" and "did a rank get SIGTERM/SIGINT?" in one
            # all-reduce: every rank stops at the same step, also when the failure of a background
            # write (or the signal) reached one rank first.
            moe = [self.model.moe_aux_loss] if self.model_args.is_moe else []  # the last micro-step's
            mean_loss, any_failed, any_signal, *moe_aux = all_reduce_mean(torch.stack(
                [loss, loss.new_tensor(float(failure is not None)), loss.new_tensor(float(signals.received)), *moe]))
            if any_failed:
                raise exits.save_failed(self.manager, failure)
            losses.append(mean_loss)
            if any_signal:
                self._stop_after(step, signals.signum or signal.SIGTERM)
            window.add(data_s=self.data_s, stall_s=self.checkpoints.stall_s - before)
            if step % cfg.metrics.log_freq == 0 or step == t.steps:
                synchronize(self.device_type)
                grad_norm = step_mod.norm_value(self.grad_norm)  # every rank: a DTensor's is reduced
                times = window.figures(excluded_s=waited)  # training's time, not the final drain
                tps = window.steps * tokens_per_step / times.pop("seconds")
                self.metrics.log({
                    "step": step,
                    "loss": losses[-1],
                    "grad_norm": grad_norm,
                    "lr": self.scheduler.get_last_lr()[0],
                    "tokens_per_sec": tps,
                    "tokens_per_sec_per_device": tps / self.world,
                    "mfu_pct": None if self.peak is None else 100 * self.flops_per_token * tps / self.world / self.peak,
                    **times,
                    "memory_gib": peak_memory_gib(self.device_type),
                    "ckpt_failures": self.checkpoints.failures,
                    **self.checkpoints.memory_counts,
                    **({"moe_aux_loss": moe_aux[0]} if moe_aux else {}),
                })
                window.open()
            collect_garbage(step)
        return losses[first:]

    def _stop_after(self, step: int, signum: int) -> None:
        """A rank got SIGTERM/SIGINT: with checkpoint.save_on_signal, save this step (unless it was
        just saved); then stop (the in-flight saves finish when the run closes)."""
        if self.cfg.checkpoint.save_on_signal and self.checkpoints.last_saved != step:
            failure = self.checkpoints.save(step, self.state, force=True)
            if failure is not None:
                raise exits.save_failed(self.manager, failure)
        raise Stopped(signum, f"stopped by {StopSignals.name(signum)} after step {step}")

    def figures(self) -> dict:
        """The run so far, for its run_end record and summary line."""
        t, seconds = self.cfg.training, time.perf_counter() - self.started
        return {"steps": len(self.losses), "last_step": self.train_state.step, "seconds": round(seconds, 3),
                "overall_tokens_per_sec": len(self.losses) * t.batch_size * t.seq_len / max(seconds, 1e-9),
                "final_loss": self.losses[-1] if self.losses else None}

    def close(self, *, quiet: bool = False, finished: bool = True) -> None:
        """Release everything. ``quiet``: already failing, so a further checkpoint error is dropped
        (the first one is reported) instead of raised; ``finished``: the run ended well (not quiet, not
        stopped), so the memory tier's steps go. The run_end record comes after the last saves."""
        status = "failed" if quiet else "finished" if finished else "stopped"
        try:
            if self.manager is not None:
                self.checkpoints.close(finished=finished and not quiet)
        except (exits.Failed, ckpt.CheckpointError):
            status = "failed"
            if not quiet:
                raise
        finally:
            if self.metrics is not None and self.metrics.enabled:
                self.metrics.record(run_end(self.run_id, status=status, figures=self.figures(),
                                            checkpoints=self.checkpoints.totals() if self.manager else {}))
                self.metrics.close()
            if self._owns_process_group and dist.is_initialized():
                dist.destroy_process_group()


def _train(argv: list[str]) -> None:
    threads = set_torch_threads()  # before the model is built (trainer.threads)
    trainer = Trainer(load_config(argv))
    try:
        if trainer.nothing_to_train is not None:  # a rerun of a finished job: say so, write nothing
            trainer.log(trainer.nothing_to_train)
            trainer.close()
            return
        trainer.log(run_lines.header(trainer, threads))
        trainer.fit()
    except Stopped as stop:  # preempted: the saves in flight finish, then the newest step is named
        trainer.close(finished=False)
        newest = trainer.checkpoints.newest() if trainer.manager is not None else None
        trainer.log(f"{stop}; " + (f"newest committed step {newest} (a restart resumes from it)" if newest is not None
                                   else "no checkpoint committed"))
        raise
    except BaseException:
        trainer.close(quiet=True)
        raise
    trainer.close()
    trainer.log(run_lines.summary(trainer.figures(), trainer.checkpoints if trainer.manager is not None else None))


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--dry-run" in argv:  # the memory and checkpoint plan of this config, no process group (trainer.plan)
        rest = [arg for arg in argv if arg not in ("--dry-run", "--measure")]
        if "--measure" in argv:  # and one step of it measured on a fake process group (trainer.measure)
            from .measure.cli import main as measured_dry_run

            return measured_dry_run(rest)
        from .plan.cli import main as dry_run

        return dry_run(rest)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        print(help_text())
        return exits.DONE
    try:
        return exits.run(lambda: _train(argv))
    finally:  # the trainer is unreferenced by now: its process groups go before the interpreter does
        exits.release_process_groups()


if __name__ == "__main__":
    raise SystemExit(main())

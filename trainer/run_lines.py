"""The lines a run prints about itself: the header (model, parameters, layout, threads), the summary
at the end (steps, time, tokens/s, final loss, checkpoints written and kept, the newest), the one
line of a run that has nothing to train, and the one of a resume whose ``training.lr`` is not the
resumed run's."""

from __future__ import annotations

import torch

from . import model as model_mod


def params_text(trainer) -> str:
    """The model's parameter count (global, whatever the sharding) and, under a pipeline, the
    share of this rank's stage(s) — FSDP/TP shards are counted at their global size (DTensor)."""
    with torch.device("meta"):
        total = model_mod.num_params(model_mod.Transformer(trainer.model_args))
    if trainer.dims.pp == 1:
        return f"{total:,} params"
    return f"{total:,} params, {model_mod.num_params(trainer.model):,} in this rank's pipeline stage(s)"


def header(trainer, threads: str) -> str:
    """The run's first line (``threads``: :func:`trainer.threads.set_torch_threads`'s text)."""
    return (f"training {trainer.cfg.model.name}/{trainer.cfg.model.flavor} ({params_text(trainer)}) "
            f"on {trainer.world} x {trainer.device_type}, dp={trainer.dims.dp}, cp={trainer.dims.cp}, "
            f"micro_batch={trainer.micro_batch}, accumulation={trainer.accumulation}, {threads}")


def summary(figures: dict, checkpoints=None) -> str:
    """The run's last line from :meth:`trainer.train.Trainer.figures` and, with checkpointing, the
    run's :class:`trainer.checkpointing.RunCheckpoints`: checkpoints written, kept, the newest and where."""
    line = (f"run finished: {figures['steps']} steps in {figures['seconds']:.1f} s, "
            f"{figures['overall_tokens_per_sec']:,.0f} tokens/s")
    if figures["final_loss"] is not None:
        line += f", final loss {figures['final_loss']:.4f}"
    if checkpoints is not None:
        line += checkpoints.summary(checkpoints.totals())
    return line


def nothing_to_train(resumed_step: int | None, steps: int) -> str | None:
    """The line of a run whose resumed checkpoint is already at or past ``training.steps`` (a rerun
    of a finished job, or a smaller ``steps``); None when there is something to train."""
    if resumed_step is None or resumed_step < steps:
        return None
    return (f"checkpoint step {resumed_step} is already {'past' if resumed_step > steps else 'at'} "
            f"training.steps = {steps}: nothing to train; raise --training.steps or use another dump folder")


def resumed_lr(configured: float, scheduler) -> str | None:
    """The line of a resume whose ``training.lr`` differs from the learning rate the resumed run was
    scheduled with (its scheduler's ``base_lrs``, restored with the checkpoint): the schedule goes on
    at the saved rate, as torchtitan's resume does; None when they agree."""
    saved = sorted(set(scheduler.base_lrs))
    if saved == [configured]:
        return None
    rates = ", ".join(f"{rate:g}" for rate in saved)
    return (f"training.lr = {configured:g} is not the resumed run's ({rates}): the optimizer and its learning-rate "
            f"schedule go on as saved, at {rates}; a changed rate takes effect only in a new run")

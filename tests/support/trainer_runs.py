"""The trainer in the tests' process: the debug model's command line and one run of it.

``trainer_args(folder, steps, **extra)`` is the command line of a short debug-model run dumping into
``folder`` (a checkpoint every 10 steps, metrics every 5; ``extra`` keys are config keys with ``__``
for ``.``, e.g. ``checkpoint__keep=2``); ``run_trainer(argv, stop_at)`` builds the :class:`Trainer`
of that command line, fits it (stopping after ``stop_at`` steps when given) and returns the losses,
the full (unsharded) model and optimizer state and the loader's state; ``logged_losses(folder)`` the
losses a run (and its restarts) logged, by step.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import REPO, models


def trainer_args(folder: str, steps: int = 20, **extra) -> list[str]:
    args = ["--config", str(REPO / "configs" / "debug.toml"), "--job.dump_folder", folder,
            "--training.steps", str(steps), "--training.seq_len", "64", "--training.batch_size", "8",
            "--checkpoint.interval", "10", "--metrics.log_freq", "5"]
    for key, value in extra.items():
        args += [f"--{key.replace('__', '.')}", str(value)]
    return args


def run_trainer(argv: list[str], stop_at: int | None = None):
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(argv))
    try:
        losses = trainer.fit(stop_at=stop_at)
        full = models.full_state(trainer.model, trainer.optimizer)
        return losses, full, trainer.loader.state_dict()
    finally:
        trainer.close()


def logged_losses(job: str | Path) -> dict[int, float]:
    """The last logged loss of each step in ``job``'s metrics.jsonl (a restart's records come later)."""
    losses = {}
    for line in (Path(job) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses

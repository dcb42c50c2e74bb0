"""The hand-written training loop the trainer is measured against: the trainer's model, data and
hyper-parameters, and nothing else.

:func:`build` makes, from a trainer config, what ``Trainer`` makes for the same config — the model
(``cfg.model_args`` of the trainer's tokenizer, seeded by ``job.seed``), the data
(``load_training_tokens``, ``DataLoader`` with the same seed, batch and sequence length) and AdamW
with the trainer's hyper-parameters and LR schedule — with no process group, no wrapper, no
checkpointing, no metrics. ``shard`` (optional) wraps the model in place before the optimizer is
built (FSDP2 by hand, say); ``rank``/``world`` pick this rank's slice of every batch.

:meth:`MinimalLoop.step` is one step: batch, ``model(inputs)`` + ``cross_entropy``, ``backward``,
``clip_grad_norm_``, optimizer ``step`` + scheduler ``step`` + ``zero_grad(set_to_none=True)``,
``loss.item()``. ``mark`` (optional) is called between the phases — before the batch and after each
of the five phases of :data:`PHASES` — so a per-phase breakdown times the same code the loop runs
(CPU ops are synchronous). The same step drives a ``Trainer``'s own model, optimizer, scheduler and
loader when a :class:`MinimalLoop` is built from them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import harness  # noqa: F401  first: puts this checkout's root on sys.path

from trainer import data as data_mod  # noqa: E402
from trainer import model as model_mod  # noqa: E402
from trainer.optim import lr_lambda  # noqa: E402

PHASES = ("data", "forward + loss", "backward", "clip_grad_norm_", "optimizer step + zero_grad")


@dataclass
class MinimalLoop:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: data_mod.DataLoader
    max_norm: float
    foreach: bool | None = None  # clip_grad_norm_'s; the trainer clips with foreach=True

    def step(self, mark: Callable[[], None] = lambda: None) -> float:
        """One training step; its loss."""
        mark()
        inputs, labels = self.loader.next_batch()
        mark()
        loss = F.cross_entropy(self.model(inputs).flatten(0, 1).float(), labels.flatten())
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=self.foreach)
        mark()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        mark()
        return value


def build(cfg, rank: int = 0, world: int = 1, shard: Callable[[torch.nn.Module], None] | None = None,
          foreach: bool | None = None) -> MinimalLoop:
    """The loop of the trainer config ``cfg`` (``trainer.config.load_config``)."""
    t = cfg.training
    tokenizer, tokens = data_mod.load_training_tokens(cfg.model.tokenizer, t.dataset, t.seq_len)
    torch.manual_seed(cfg.job.seed)
    model = model_mod.build(cfg.model_args(tokenizer.vocab_size))
    if shard is not None:
        shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t.warmup_steps, t.steps, t.min_lr_ratio))
    loader = data_mod.DataLoader(tokens, t.seq_len, t.batch_size, rank, world, cfg.job.seed)
    return MinimalLoop(model, opt, sched, loader, t.max_norm, foreach)


def phase_marks(marks: list[float]) -> Callable[[], None]:
    """A ``mark`` for :meth:`MinimalLoop.step` that records ``time.perf_counter()`` into ``marks``."""
    return lambda: marks.append(time.perf_counter())

"""torchtitan's side of a job on the CPU, for the tests of :mod:`ckpt.integrations.torchtitan`.

torchtitan's Trainer has no CPU path and its models import triton, so :class:`Job` builds what the
Trainer builds before ``config.checkpoint.build(...)`` (torchtitan's real OptimizersContainer,
LRSchedulersContainer and ParallelAwareDataloader over a tiny model, tests.support.models) and runs
its train step; :func:`job_config` selects the checkpoint manager the way a torchtitan job does
(config, then ``override.imports`` applied to the tree). Import only where torchtitan is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.checkpointer import CheckpointManager as TitanManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config import Configurable, OverrideConfig, apply_overrides

from tests.support.models import build, parallelize

OVERRIDE = "ckpt.integrations.torchtitan.ckpt_engine"


class Tokens(IterableDataset):
    """A deterministic stream of token rows, different per data-parallel rank."""

    def __init__(self, rank: int):
        self.rank = rank

    def __iter__(self):
        g = torch.Generator().manual_seed(100 + self.rank)
        while True:
            yield torch.randint(0, 13, (9,), generator=g)


class TrainState:
    """The trainer's own Stateful (torchtitan's Trainer: step and ntokens_seen)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


@dataclass(kw_only=True, slots=True)
class JobConfig(Configurable.Config):
    """The two fields of torchtitan's Trainer.Config that choose the checkpoint manager."""

    checkpoint: BaseCheckpointManager.Config = field(default_factory=TitanManager.Config)
    override: OverrideConfig = field(default_factory=OverrideConfig)


def job_config(folder: str, imports: list, **checkpoint) -> JobConfig:
    """torchtitan's order: config (registry + CLI), then overrides applied to the tree."""
    config = JobConfig(checkpoint=TitanManager.Config(enable=True, folder=folder, **checkpoint),
                       override=OverrideConfig(imports=imports))
    apply_overrides(config.override, config)
    return config


class Job:
    """What torchtitan's Trainer builds before ``config.checkpoint.build(...)``, on the CPU."""

    def __init__(self, rank: int, world: int, config: JobConfig, base: str, seed: int, layout: str = "fsdp",
                 model: torch.nn.Module | None = None):
        self.model = model if model is not None else parallelize(build(seed), layout)
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
            implementation="for-loop").build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=10)
        self.dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=2)
        self.train_state = TrainState()
        self.checkpointer = config.checkpoint.build(
            dataloader=self.dataloader, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers, states={"train_state": self.train_state}, sd_adapter=None,
            base_folder=base)
        self.batches = None  # torchtitan starts iterating after checkpointer.load()
        self.loader_received = None
        load_state_dict = self.dataloader.load_state_dict

        def received(state):
            self.loader_received = dict(state)
            load_state_dict(state)

        self.dataloader.load_state_dict = received

    def train_step(self) -> float:
        """torchtitan's train_step on the CPU: forward, backward, wait for staging, step."""
        self.train_state.step += 1
        if self.batches is None:
            self.batches = iter(self.dataloader)
        ids = next(self.batches)
        logits = self.model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        self.lr_schedulers.step()
        self.optimizers.zero_grad()
        self.train_state.ntokens_seen += ids.numel()
        return loss.item()

    def snapshot(self) -> dict:
        """Everything a resume must restore, as this rank holds it (local shards, bytes as bytes)."""
        def local(value):
            value = value.to_local() if hasattr(value, "to_local") else value
            return value.detach().clone() if isinstance(value, torch.Tensor) else value

        def walk(node):
            if isinstance(node, dict):
                return {k: walk(v) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                return [walk(v) for v in node]
            return local(node)

        # the dataloader's state as it was given back (its own state_dict() before it iterates again
        # reports a fast-forward still to come), else as it is now
        loader = self.loader_received if self.loader_received is not None else self.dataloader.state_dict()
        return {"model": walk(self.model.state_dict()), "params": walk(dict(self.model.named_parameters())),
                "optimizer": walk(self.optimizers.state_dict()),
                "raw_optimizer": [walk(o.state_dict()) for o in self.optimizers.optimizers],
                "lr_scheduler": self.lr_schedulers.state_dict(), "dataloader": loader,
                "train_state": self.train_state.state_dict(),
                "lr": [g["lr"] for o in self.optimizers.optimizers for g in o.param_groups]}


def assert_bitwise(actual, expected, path="state"):
    assert type(actual) is type(expected), (path, type(actual), type(expected))
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), path
        for key in expected:
            assert_bitwise(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise(a, e, f"{path}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), path
    else:
        assert actual == expected, path


def llama_job(base: str, imports: list, seed: int, **options) -> Job:
    """torchtitan's llama3 debugmodel (its classes, tests/support/titan_llama3.py) under the Job's
    torchtitan containers, one process, the manager chosen as a job chooses it."""
    from tests.support import titan_llama3

    model = titan_llama3.build(seed=seed)  # skips without torchtitan's llama3
    return Job(0, 1, job_config("checkpoint", imports, **options), base, seed=seed, model=model)


def seeded_step(job: Job) -> None:
    """One optimizer step as torchtitan's train_step takes it, with gradients seeded per step
    (torchtitan's flex attention has no backward on the CPU); they depend on the weights, so a
    wrongly restored weight changes every later step."""
    job.train_state.step += 1
    generator = torch.Generator().manual_seed(1000 + job.train_state.step)
    for param in job.model.parameters():
        param.grad = torch.randn(param.shape, generator=generator) * 1e-2 + 1e-3 * param.detach()
    job.checkpointer.maybe_wait_for_staging()
    job.optimizers.step()
    job.lr_schedulers.step()
    job.optimizers.zero_grad()

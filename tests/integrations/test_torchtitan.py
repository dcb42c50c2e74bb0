"""ckpt.integrations.torchtitan: torchtitan's own checkpoint flow (config -> override -> build -> load,
train, maybe_wait_for_staging before the optimizer step, save) with our manager, over torchtitan's real
ModelWrapper, OptimizersContainer, LRSchedulersContainer and ParallelAwareDataloader, on 2 CPU gloo ranks
under FSDP2. torchtitan has no CPU trainer and its models import triton, so the trainer's loop is
driven here with a tiny model (tests.support.models); everything the checkpoint touches is torchtitan's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan (the torchtitan extra) not installed")

import torch.nn.functional as F  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.checkpointer import BaseCheckpointManager  # noqa: E402
from torchtitan.components.checkpointer import CheckpointManager as TitanManager  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402
from torchtitan.config import Configurable, OverrideConfig, apply_overrides  # noqa: E402

import ckpt  # noqa: E402
from ckpt.integrations import torchtitan as titan  # noqa: E402
from tests.support import REPO  # noqa: E402
from tests.support.launch import run_ranks  # noqa: E402
from tests.support.models import build, parallelize  # noqa: E402

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

    def __init__(self, rank: int, world: int, config: JobConfig, base: str, seed: int, layout: str = "fsdp"):
        self.model = parallelize(build(seed), layout)
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
        return {"model": walk(self.model.state_dict()), "optimizer": walk(self.optimizers.state_dict()),
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


def _resume_job(rank: int, world: int, base: str) -> dict:
    options = {"interval": 2, "async_mode": "async_with_pinned_mem", "keep_latest_k": 0}
    config = job_config("checkpoint", [OVERRIDE], **options)
    assert type(config.checkpoint) is titan.CheckpointManager.Config
    first = Job(rank, world, config, base, seed=0)
    assert isinstance(first.checkpointer, titan.CheckpointManager)
    assert first.checkpointer.load(step=config.checkpoint.load_step) is False  # fresh start
    losses = []
    for _ in range(4):
        losses.append(first.train_step())
        if first.train_state.step == 2:
            first.checkpointer.save(2)
            first.checkpointer.maybe_wait_for_staging()
            at_two = first.snapshot()
        else:
            first.checkpointer.save(first.train_state.step)
    first.checkpointer.close()
    committed = sorted(int(name.split("-")[1]) for name in os.listdir(os.path.join(base, "checkpoint"))
                       if name.startswith("step-"))

    # a fresh job (other initial weights), same config with load_step 2: torchtitan's resume path
    config = job_config("checkpoint", [OVERRIDE], load_step=2, **options)
    second = Job(rank, world, config, base, seed=7)
    assert second.checkpointer.load(step=config.checkpoint.load_step) is True
    resumed = second.snapshot()
    again = [second.train_step(), second.train_step()]
    second.checkpointer.close()
    return {"at_two": at_two, "resumed": resumed, "losses": losses, "again": again, "committed": committed,
            "rank_key": f"dp_rank_{rank}"}


@pytest.mark.slow
def test_torchtitan_flow_resumes_bitwise_on_two_ranks(tmp_path):
    results = run_ranks(2, _resume_job, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["committed"] == [2, 4]
        assert result["again"] == result["losses"][2:]  # training continues exactly
        assert_bitwise(result["resumed"], result["at_two"], f"rank{rank}")
        assert list(result["resumed"]["dataloader"]) == [result["rank_key"], "world_size"]
    # each rank saved its own position under its own key (rank-local state) and got it back strictly
    manifest = ckpt.read_manifest(tmp_path / "checkpoint" / "step-00000002")
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1", "dataloader.world_size"} <= set(manifest.values)
    assert {key.split(".")[0] for key in (*manifest.values, *manifest.tensors)} >= {
        "train_state", "lr_scheduler", "optimizer", "emb"}  # torchtitan's layout: model keys at the top


def test_override_selects_our_manager_and_copies_every_field(tmp_path):
    config = job_config("ck", [(OVERRIDE, {"full_every": 3, "keep_every": 10, "replicas": [str(tmp_path / "r")]})],
                        interval=5, keep_latest_k=4, async_mode="async", exclude_from_loading=["dataloader"])
    ours = config.checkpoint
    assert type(ours) is titan.CheckpointManager.Config
    assert (ours.interval, ours.keep_latest_k, ours.async_mode, ours.exclude_from_loading) == (5, 4, "async",
                                                                                               ["dataloader"])
    options = ours.save_options()
    assert (options.interval, options.keep, options.keep_every, options.full_every) == (5, 4, 10, 3)
    assert options.async_mode is ckpt.options.AsyncMode.DOUBLE_BUFFER
    assert options.replicas == (str(tmp_path / "r"),)
    assert job_config("ck", [OVERRIDE], async_mode="disabled").checkpoint.save_options().async_mode.value == "sync"
    assert job_config("ck", [OVERRIDE], keep_latest_k=0).checkpoint.save_options().keep >= 2**31 - 1
    with pytest.raises(ValueError, match="unknown options"):
        job_config("ck", [(OVERRIDE, {"fulll_every": 3})])


def test_cli_line_selects_our_manager():
    """The exact CLI tokens of the docs, parsed by torchtitan's own parser for override.imports."""
    from torchtitan.config.override import parse_cli_imports

    entries = parse_cli_imports([OVERRIDE, f'{OVERRIDE}={{"full_every": 4}}'])
    assert entries == [OVERRIDE, (OVERRIDE, {"full_every": 4})]


def _single(base, seed=0, engine=None, **options):
    """One process, no process group: the same flow on a plain model (``engine``: override kwargs)."""
    config = job_config("checkpoint", [(OVERRIDE, engine) if engine else OVERRIDE], **options)
    return Job(0, 1, config, base, seed=seed, layout="plain")


def test_last_step_model_only_in_export_dtype_loads_into_the_model_alone(tmp_path):
    job = _single(str(tmp_path), interval=2, export_dtype="bfloat16", async_mode="disabled")
    for _ in range(3):
        job.train_step()
        job.checkpointer.save(job.train_state.step, last_step=job.train_state.step == 3)
    job.checkpointer.close()
    manifest = ckpt.read_manifest(tmp_path / "checkpoint" / "step-00000003")
    assert {e.dtype for e in manifest.tensors.values()} == {torch.bfloat16}
    assert not manifest.values  # the model alone
    fresh = _single(str(tmp_path), interval=2, async_mode="disabled")
    assert fresh.checkpointer.load() is True
    assert fresh.train_state.step == 0  # model-only: the rest is not touched
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, job.model.state_dict()[key].to(torch.bfloat16).float()), key
    fresh.checkpointer.close()


def test_deltas_and_replicas_from_the_override_options(tmp_path):
    replica = tmp_path / "replica"
    engine = {"full_every": 2, "replicas": [str(replica)]}
    job = _single(str(tmp_path), engine=engine, interval=1, async_mode="async", keep_latest_k=3)
    for _ in range(4):
        job.train_step()
        job.checkpointer.save(job.train_state.step)
    job.checkpointer.close()
    kinds = {s: ckpt.read_manifest(tmp_path / "checkpoint" / f"step-{s:08d}").kind for s in (2, 3, 4)}
    assert kinds[2] != "full" and kinds[3] == "full" and kinds[4] != "full", kinds
    assert sorted(p.name for p in replica.glob("step-*")) == sorted(
        p.name for p in (tmp_path / "checkpoint").glob("step-*"))
    fresh = _single(str(tmp_path), seed=3, engine=engine, async_mode="async")
    assert fresh.checkpointer.load() is True and fresh.train_state.step == 4
    for key, value in fresh.model.state_dict().items():
        assert torch.equal(value, job.model.state_dict()[key]), key
    fresh.checkpointer.close()


def test_seed_checkpoint_is_step_zero_of_the_model_alone(tmp_path):
    """torchtitan's train.py with create_seed_checkpoint: save(curr_step=0, last_step=True)."""
    seed = _single(str(tmp_path), create_seed_checkpoint=True)
    assert seed.checkpointer.save(curr_step=0, last_step=True) is True
    seed.checkpointer.close()
    assert not ckpt.read_manifest(tmp_path / "checkpoint" / "step-00000000").values
    job = _single(str(tmp_path), seed=1)
    assert job.checkpointer.load() is True
    for key, value in job.model.state_dict().items():
        assert torch.equal(value, seed.model.state_dict()[key]), key
    job.train_step()  # and training starts from it: step 1, the optimizer fresh
    assert job.train_state.step == 1
    job.checkpointer.close()


def test_first_step_load_only_and_exclude_from_loading(tmp_path):
    job = _single(str(tmp_path), interval=5, enable_first_step_checkpoint=True, async_mode="disabled")
    job.train_step()
    assert job.checkpointer.save(1) is True
    job.train_step()
    assert job.checkpointer.save(2) is False
    job.checkpointer.close()
    fresh = _single(str(tmp_path), load_only=True, exclude_from_loading=["train_state"])
    assert fresh.checkpointer.load() is True
    assert fresh.train_state.step == 0 and fresh.lr_schedulers.state_dict()["last_epoch"] == 1
    fresh.train_step()
    assert fresh.checkpointer.save(5) is False  # load_only: never saves
    fresh.checkpointer.close()
    with pytest.raises(FileNotFoundError, match="load_step=4"):
        other = _single(str(tmp_path), load_step=4)
        try:
            other.checkpointer.load(step=4)
        finally:
            other.checkpointer.close()


def _titan_writes(rank: int, world: int, base: str) -> dict:
    """torchtitan's plain manager writes step 2; ours starts from it as initial_load_path."""
    plain = job_config("titan", [], interval=2)
    job = Job(rank, world, plain, base, seed=0)
    for _ in range(2):
        job.train_step()
        job.checkpointer.save(job.train_state.step)
    job.checkpointer.close()
    written = job.snapshot()
    config = job_config("ours", [OVERRIDE], initial_load_path=os.path.join(base, "titan", "step-2"),
                        initial_load_model_only=False)
    fresh = Job(rank, world, config, base, seed=5)
    assert fresh.checkpointer.load() is True
    resumed = fresh.snapshot()
    fresh.checkpointer.close()
    return {"written": written, "resumed": resumed}


@pytest.mark.slow
def test_initial_load_path_from_a_torchtitan_checkpoint_on_two_ranks(tmp_path):
    for rank, result in enumerate(run_ranks(2, _titan_writes, str(tmp_path))):
        assert_bitwise(result["resumed"], result["written"], f"rank{rank}")


def test_module_imports_without_triton_and_names_the_extra():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import ckpt.integrations.torchtitan\n"
            "assert 'torchtitan.trainer' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    missing = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torchtitan'] = None\n"
                              "import ckpt.integrations.torchtitan"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert "pip install 'ckpt-engine[torchtitan]'" in missing.stderr, missing.stderr

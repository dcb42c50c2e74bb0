"""ckpt.integrations.torchtitan: torchtitan's own checkpoint flow (config -> override -> build -> load,
train, maybe_wait_for_staging before the optimizer step, save) with our manager, over torchtitan's real
ModelWrapper, OptimizersContainer, LRSchedulersContainer and ParallelAwareDataloader, on 2 CPU gloo ranks
under FSDP2. torchtitan has no CPU trainer and its models import triton, so the trainer's loop is
driven by tests.support.titan with a tiny model; everything the checkpoint touches is torchtitan's.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan (the torchtitan extra) not installed")

from torchtitan.config import apply_overrides  # noqa: E402

import ckpt  # noqa: E402
from ckpt.integrations import torchtitan as titan  # noqa: E402
from tests.support.launch import run_ranks  # noqa: E402
from tests.support.titan import OVERRIDE, Job, assert_bitwise, job_config, llama_job, seeded_step  # noqa: E402


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
    assert options.memory is None  # the memory tier is off unless asked for
    memory = job_config("ck", [(OVERRIDE, {"memory": "/dev/shm/ckpt", "memory_interval": 2, "memory_keep": 3,
                                           "memory_replicas": 0, "memory_keep_on_exit": True})]).checkpoint
    options = memory.save_options()
    assert (options.memory, options.memory_interval, options.memory_keep, options.memory_replicas,
            options.memory_keep_on_exit) == ("/dev/shm/ckpt", 2, 3, 0, True)
    assert job_config("ck", [OVERRIDE], async_mode="disabled").checkpoint.save_options().async_mode.value == "sync"
    assert job_config("ck", [OVERRIDE], keep_latest_k=0).checkpoint.save_options().keep >= 2**31 - 1
    with pytest.raises(ValueError, match="unknown options"):
        job_config("ck", [(OVERRIDE, {"fulll_every": 3})])


def test_cli_lines_select_our_manager():
    """The docs' CLI lines, parsed as torchtitan's ConfigManager parses them (tyro, its rules), then
    the overrides applied; and a config_registry default of our Config taking our flags."""
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    from tests.support.titan import JobConfig

    ConfigManager()  # registers torchtitan's parsing rules (override.imports, comma lists)
    args = ["--checkpoint.enable", "--checkpoint.interval", "7", "--checkpoint.async_mode", "async_with_pinned_mem",
            "--override.imports", f'{OVERRIDE}={{"full_every": 4}}']
    config = tyro.cli(JobConfig, args=args, default=JobConfig(), registry=custom_registry)
    apply_overrides(config.override, config)
    ours = config.checkpoint
    assert type(ours) is titan.CheckpointManager.Config
    assert (ours.enable, ours.interval, ours.async_mode, ours.full_every) == (True, 7, "async_with_pinned_mem", 4)
    default = JobConfig(checkpoint=titan.CheckpointManager.Config(enable=True))
    config = tyro.cli(JobConfig, args=["--checkpoint.full_every", "5", "--checkpoint.replicas", "s3://b/r",
                                       "--checkpoint.memory", "/dev/shm/ckpt", "--checkpoint.memory_interval", "3"],
                      default=default, registry=custom_registry)
    assert (config.checkpoint.full_every, config.checkpoint.replicas) == (5, ["s3://b/r"])
    assert (config.checkpoint.memory, config.checkpoint.memory_interval) == ("/dev/shm/ckpt", 3)


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


def test_a_damaged_newest_step_is_passed_over(tmp_path):
    job = _single(str(tmp_path), interval=1, async_mode="disabled")
    for _ in range(2):
        job.train_step()
        job.checkpointer.save(job.train_state.step)
    job.checkpointer.close()
    manifest = tmp_path / "checkpoint" / "step-00000002" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-20])
    fresh = _single(str(tmp_path), seed=4, interval=1, async_mode="disabled")
    with pytest.warns(UserWarning):
        assert fresh.checkpointer.load() is True
    assert fresh.train_state.step == 1
    fresh.checkpointer.close()


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


# -- torchtitan's own llama3 (debugmodel: FusedQKVLinear, whose state dict is made by hooks) -----------
def _llama_save_and_resume(base: str, imports: list, async_mode: str) -> dict:
    """Train 3 steps saving step 2, resume step 2 into a fresh job (other initial weights) and
    take step 3 again."""
    options = {"interval": 2, "async_mode": async_mode, "keep_latest_k": 0}
    job = llama_job(base, imports, seed=0, **options)
    assert job.checkpointer.load() is False
    for _ in range(3):
        seeded_step(job)
        job.checkpointer.save(job.train_state.step)
        if job.train_state.step == 2:
            job.checkpointer.maybe_wait_for_staging()
            at_save = job.snapshot()
    job.checkpointer.close()
    steps, step = [], torch.optim.AdamW.step
    torch.optim.AdamW.step = lambda self, *args, **kwargs: steps.append(1) or step(self, *args, **kwargs)
    try:  # the new job's build and load: the optimizer steps in neither
        fresh = llama_job(base, imports, seed=7, load_step=2, **options)
        assert fresh.checkpointer.load(step=2) is True
        steps_in_load = len(steps)  # (the LR scheduler's step wrapper keeps counting after)
    finally:
        torch.optim.AdamW.step = step
    resumed = fresh.snapshot()
    seeded_step(fresh)
    fresh.checkpointer.close()
    return {"at_save": at_save, "resumed": resumed, "continued": fresh.snapshot(), "uninterrupted": job.snapshot(),
            "steps_in_load": steps_in_load}


_LLAMA_STATES = ("model", "params", "optimizer", "raw_optimizer", "lr_scheduler", "train_state", "lr")


def test_llama3_resume_restores_the_fused_qkv_weight(tmp_path):
    """Issue 36 item 12: the fused qkv weight came back at its initial value after a resume."""
    torch.set_num_threads(1)
    ours = _llama_save_and_resume(str(tmp_path), [OVERRIDE], "disabled")
    assert any(".qkv_linear.wqkv." in key for key in ours["resumed"]["params"])
    assert ours["steps_in_load"] == 0  # AdamW's state made directly (ckpt.optim_state), no zero-gradient step
    for state in _LLAMA_STATES:
        assert_bitwise(ours["resumed"][state], ours["at_save"][state], f"vs saved: {state}")
        assert_bitwise(ours["continued"][state], ours["uninterrupted"][state], f"step 3 again: {state}")


@pytest.mark.slow
def test_llama3_resume_is_torchtitans_own_managers_resume_sync_and_async(tmp_path):
    """Every tensor of model and optimizer after our resume (sync and double-buffered) is what
    torchtitan's own CheckpointManager restores from the same run."""
    torch.set_num_threads(1)
    theirs = _llama_save_and_resume(str(tmp_path / "theirs"), [], "disabled")  # torchtitan's CheckpointManager
    assert theirs["steps_in_load"] == 1  # torch's state-dict API made AdamW's state by a zero-gradient step
    for async_mode in ("disabled", "async_with_pinned_mem"):
        ours = _llama_save_and_resume(str(tmp_path / async_mode), [OVERRIDE], async_mode)
        for state in _LLAMA_STATES:
            assert_bitwise(ours["resumed"][state], theirs["resumed"][state], f"{async_mode} vs torchtitan: {state}")
            assert_bitwise(ours["continued"][state], theirs["continued"][state], f"{async_mode} step 3: {state}")


@pytest.mark.parametrize("writer", ["ours", "torchtitan"])
def test_initial_load_model_only_takes_the_model_of_a_full_step(tmp_path, writer):
    """Issue 36 item 13: torchtitan's default initial_load_model_only=True with initial_load_path on
    a full training step (ours, or torchtitan's own DCP step) loads the model and ignores the rest,
    as torchtitan's manager does; a step lacking a model key still fails, naming it."""
    torch.set_num_threads(1)
    job = _single(str(tmp_path / "src"), engine=None, interval=2, async_mode="disabled", keep_latest_k=0) \
        if writer == "ours" else Job(0, 1, job_config("checkpoint", [], interval=2, async_mode="disabled",
                                                      keep_latest_k=0), str(tmp_path / "src"), seed=0, layout="plain")
    for _ in range(2):
        job.train_step()
        job.checkpointer.save(job.train_state.step)
    job.checkpointer.close()
    step = tmp_path / "src" / "checkpoint" / ("step-00000002" if writer == "ours" else "step-2")
    fresh = _single(str(tmp_path / "run"), seed=5, initial_load_path=str(step))  # initial_load_model_only: default
    assert fresh.checkpointer.config.initial_load_model_only is True
    untouched = fresh.snapshot()
    assert fresh.checkpointer.load() is True
    loaded = fresh.snapshot()
    fresh.checkpointer.close()
    assert_bitwise(loaded["model"], job.snapshot()["model"], "model")
    for state in ("optimizer", "raw_optimizer", "lr_scheduler", "train_state", "lr"):
        assert_bitwise(loaded[state], untouched[state], state)  # the rest is not touched
    assert fresh.loader_received is None

    other = _single(str(tmp_path / "other"), seed=5, initial_load_path=str(step))
    other.model.extra = torch.nn.Linear(2, 2)  # a model key the step does not hold
    other.checkpointer.states["model"] = type(other.checkpointer.states["model"])([other.model])
    with pytest.raises(ckpt.IncompatibleCheckpointError, match="extra.weight"):
        other.checkpointer.load()
    other.checkpointer.close()


class _RunsCode:
    """Pickles as a call of ``pathlib.Path.touch``: what DCP's own reader would run from a hostile
    ``.metadata``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_initial_load_of_a_dcp_step_reads_its_metadata_without_running_code(tmp_path):
    import pickle

    job = Job(0, 1, job_config("checkpoint", [], interval=1, async_mode="disabled", keep_latest_k=0),
              str(tmp_path / "src"), seed=0, layout="plain")
    job.train_step()
    job.checkpointer.save(1)
    job.checkpointer.close()
    step = tmp_path / "src" / "checkpoint" / "step-1"
    marker = tmp_path / "ran"
    (step / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker)), protocol=2))
    fresh = _single(str(tmp_path / "run"), seed=5, initial_load_path=str(step))
    with pytest.raises(ckpt.UnsafeCheckpointError):
        fresh.checkpointer.load()
    fresh.checkpointer.close()
    assert not marker.exists()


# -- the memory tier (issue 38): steps between torchtitan's interval saves, kept in RAM ----------------
def _crash(checkpointer) -> None:
    """What torchtitan's train.py does when training raises: trainer.close() inside its ``except``."""
    try:
        raise RuntimeError("a training step failed")
    except RuntimeError:
        checkpointer.close()


def test_llama3_resumes_from_the_memory_tier_between_storage_saves(tmp_path):
    """Storage every 4 steps, memory every step (``ckpt_engine={"memory": ...}``): a failed run resumes
    from its newest memory step (before any storage step, then newer than one), bitwise; torchtitan's
    interval still decides the storage steps; a clean close removes the run's memory steps."""
    torch.set_num_threads(1)
    memory, base = tmp_path / "shm", str(tmp_path)
    imports = [(OVERRIDE, {"memory": str(memory)})]
    options = {"interval": 4, "async_mode": "async_with_pinned_mem", "keep_latest_k": 0}
    stored = lambda: sorted(p.name for p in (tmp_path / "checkpoint").glob("step-*"))  # noqa: E731

    job = llama_job(base, imports, seed=0, **options)
    assert job.checkpointer.config.save_options().memory == str(memory)
    assert job.checkpointer.load() is False  # a fresh start
    for _ in range(3):
        seeded_step(job)
        assert job.checkpointer.save(job.train_state.step) is True  # a memory step each time
        job.checkpointer.engine.wait()  # finished before the next step: none skipped as busy (the memory gate)
    at_three = job.snapshot()
    run = job.checkpointer.engine.run
    _crash(job.checkpointer)
    assert stored() == [] and (memory / run / "step-00000003").is_dir()  # the failure kept them

    second = llama_job(base, imports, seed=7, **options)
    assert second.checkpointer.load() is True  # from memory: storage holds no step yet
    for state in _LLAMA_STATES:
        assert_bitwise(second.snapshot()[state], at_three[state], f"memory step 3: {state}")
    for _ in range(4):
        seeded_step(second)
        second.checkpointer.save(second.train_state.step)
        second.checkpointer.engine.wait()
    at_seven = second.snapshot()
    _crash(second.checkpointer)
    assert stored() == ["step-00000004"]

    third = llama_job(base, imports, seed=9, **options)
    assert third.checkpointer.load() is True  # memory step 7, newer than storage's step 4
    for state in _LLAMA_STATES:
        assert_bitwise(third.snapshot()[state], at_seven[state], f"memory step 7: {state}")
    third.checkpointer.close()  # a clean finish
    assert memory.is_dir() and not (memory / run).exists()


def test_a_run_begun_from_a_seed_resumes_from_its_memory_step(tmp_path):
    """Storage holds only the model-only seed (step 0); the run kept steps 1-2 in memory and failed
    before its first storage save: the restart takes memory step 2 (the whole state), not the seed.
    A final model-only export is not put in memory."""
    memory = tmp_path / "shm"
    seed = _single(str(tmp_path), create_seed_checkpoint=True)
    assert seed.checkpointer.save(curr_step=0, last_step=True) is True
    seed.checkpointer.close()
    engine = {"memory": str(memory)}
    job = _single(str(tmp_path), seed=1, engine=engine, interval=4)
    assert job.checkpointer.load() is True  # the seed: the model alone
    for _ in range(2):
        job.train_step()
        assert job.checkpointer.save(job.train_state.step) is True  # memory steps 1, 2
    at_two = job.snapshot()
    run = job.checkpointer.engine.run
    _crash(job.checkpointer)
    again = _single(str(tmp_path), seed=5, engine=engine, interval=4)
    assert again.checkpointer.load() is True
    assert again.train_state.step == 2
    for state, value in at_two.items():
        assert_bitwise(again.snapshot()[state], value, f"memory step 2: {state}")
    again.train_step()
    again.checkpointer.save(again.train_state.step, last_step=True)  # step 3: the final export
    again.checkpointer.close()
    assert not (memory / run).exists()  # a clean finish

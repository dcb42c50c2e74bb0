"""The trainer end to end on CPU ranks: bitwise resume, resume on another data-parallel degree,
metrics output, seed checkpoint, clean CLI errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.support import REPO, models
from tests.support.launch import run_ranks
from tests.support.trainer_runs import run_trainer, trainer_args


def _resume_same_layout(rank: int, world: int, root: str):
    straight, straight_state, _ = run_trainer(trainer_args(f"{root}/straight"))
    first, _, _ = run_trainer(trainer_args(f"{root}/resumed"), stop_at=10)
    second, resumed_state, loader = run_trainer(trainer_args(f"{root}/resumed"))
    return straight, first + second, straight_state, resumed_state, loader


@pytest.mark.slow
def test_resume_is_bitwise_on_two_fsdp_ranks(tmp_path):
    results = run_ranks(2, _resume_same_layout, str(tmp_path))
    straight, resumed, straight_state, resumed_state, loader = results[0]
    assert len(straight) == 20 and resumed == straight  # every step's loss, exactly
    models.assert_same(resumed_state, straight_state)  # final weights and AdamW state, bitwise
    assert loader["position"] == 20 * 8
    assert sum(straight[-5:]) < sum(straight[:5])  # it learns
    records = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "run_start" and records[0]["resumed_step"] is None
    lines = [r for r in records if "event" not in r]
    assert [r["step"] for r in lines] == [5, 10, 15, 20]
    assert all(r["grad_norm"] > 0 and r["step_time_ms"] >= r["data_time_ms"] >= 0 for r in lines)  # FSDP's norm reduced; data time is inside the step
    assert json.loads((tmp_path / "straight" / "config.json").read_text())["training"]["steps"] == 20
    assert all({"step", "loss", "tokens_per_sec", "ckpt_stall_ms"} <= r.keys() for r in lines)
    steps = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000010", "step-00000020"]


def _train_two_ranks(rank: int, world: int, root: str):
    return run_trainer(trainer_args(f"{root}/two", steps=12))[0], run_trainer(trainer_args(f"{root}/stop", steps=12), stop_at=10)[0]


@pytest.mark.slow
def test_resume_on_another_data_parallel_degree(tmp_path):
    straight, _ = run_ranks(2, _train_two_ranks, str(tmp_path))[0]
    # One process continues the 2-rank run's step-10 checkpoint: same global samples, so the same
    # losses up to reduction order.
    losses, _, loader = run_trainer(trainer_args(str(tmp_path / "stop"), steps=12))
    assert loader["position"] == 12 * 8
    assert losses == pytest.approx(straight[10:], rel=1e-4)


@pytest.mark.slow
def test_seed_checkpoint_and_load_step(tmp_path):
    run_trainer(trainer_args(str(tmp_path), steps=20, checkpoint__create_seed_checkpoint="true"))
    assert (tmp_path / "checkpoints" / "step-00000000" / "manifest.json").is_file()
    losses, _, loader = run_trainer(trainer_args(str(tmp_path), steps=4, checkpoint__interval=2))
    assert len(losses) == 4 and loader["position"] == 32  # started from the seed checkpoint (step 0)
    losses, _, loader = run_trainer(trainer_args(str(tmp_path), steps=3, checkpoint__load_step=2,
                                                 checkpoint__branch="true"))  # step 4 is there: a branch
    assert len(losses) == 1 and loader["position"] == 24  # step 3 only, from step 2's checkpoint
    assert not torch.distributed.is_initialized()  # the trainer closed the group it started


def _train_variant(rank: int, world: int, root: str, variant: dict):
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(trainer_args(root, steps=6, checkpoint__enable="false", **variant)))
    try:
        losses = trainer.fit()
        full = models.full_state(trainer.model, trainer.optimizer)
        return losses, {k: v.dtype for k, v in full["model"].items()}, type(trainer.model).__name__
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize("variant, wrapper", [
    ({"optimization__zero_stage": 0, "training__gradient_accumulation_steps": 2,
      "optimization__gradient_checkpointing": "true"}, "DistributedDataParallel"),
    ({"optimization__zero_stage": 2, "optimization__precision": "bf16", "training__micro_batch_size": 2},
     "FSDPTransformer"),
])
def test_ddp_fsdp_bf16_accumulation_and_activation_checkpointing(tmp_path, variant, wrapper):
    losses, dtypes, model_type = run_ranks(2, _train_variant, str(tmp_path), variant)[0]
    assert model_type == wrapper
    assert len(losses) == 6 and all(l == l and l < 10 for l in losses)
    assert sum(losses[-2:]) < sum(losses[:2])
    assert set(dtypes.values()) == {torch.float32}  # fp32 master weights


@pytest.mark.slow
def test_one_process_trains_the_model_unwrapped_in_bf16(tmp_path):
    # One data-parallel rank: nothing to shard, so no FSDP2/DDP wrapper (torchtitan does the same);
    # bf16 then runs through autocast over fp32 weights.
    losses, dtypes, model_type = _train_variant(0, 1, str(tmp_path), {"optimization__precision": "bf16"})
    assert model_type == "Transformer"
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2])
    assert set(dtypes.values()) == {torch.float32}


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainer.train", *trainer_args(str(tmp_path)), "--training.bogus", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "bogus" in result.stderr
    result = subprocess.run([sys.executable, "-m", "trainer.train", *trainer_args(str(tmp_path)), "--parallelism.tp", "2"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "not divisible" in result.stderr  # tp 2 on one process


def test_scheduled_garbage_collection_restores_the_interpreter_setting(monkeypatch):
    import gc

    from trainer.gc_schedule import scheduled_garbage_collection

    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    assert gc.isenabled()
    with scheduled_garbage_collection(3) as collect:
        assert not gc.isenabled()
        for step in range(1, 8):
            collect(step)
    assert gc.isenabled() and collected == [1, 1, 1]  # on entry, then at steps 3 and 6
    with scheduled_garbage_collection(0) as collect:
        assert gc.isenabled()
        collect(3)
    assert collected == [1, 1, 1]


@pytest.mark.slow
def test_checkpoints_on_s3_with_a_replica_resume_from_the_replica(tmp_path, s3_bucket, aws_env):
    """checkpoint.folder an s3:// URL (credentials from the environment), checkpoint.replicas a local
    directory; the primary's newest step vanishes and the run resumes from the replica's copy."""
    from ckpt.root import CheckpointRoot

    folder, replica = f"{s3_bucket.url}/run", str(tmp_path / "replica")
    extra = {"checkpoint__enable": "true", "checkpoint__folder": folder, "checkpoint__replicas": replica,
             "checkpoint__interval": 4}
    straight, _, _ = run_trainer(trainer_args(str(tmp_path / "straight"), steps=8))
    first, _, _ = run_trainer(trainer_args(str(tmp_path / "job"), steps=8, **extra), stop_at=4)
    assert CheckpointRoot(replica).steps() == [4]
    CheckpointRoot(folder).delete(4)
    with pytest.warns(UserWarning, match="loaded from replica"):
        second, _, _ = run_trainer(trainer_args(str(tmp_path / "job"), steps=8, **extra))
    assert first + second == straight
    assert CheckpointRoot(folder).steps() == [8] and CheckpointRoot(replica).steps() == [4, 8]


def test_initial_load_path_takes_the_model_weights_only_until_the_run_has_its_own(tmp_path, capsys):
    """checkpoint.initial_load_path: a model-only checkpoint (what ckpt-convert --from hf writes) seeds
    the weights; optimizer, schedule and data start fresh; once the run has saved, it resumes from its
    own folder and the initial checkpoint is ignored. No checkpoint there, or weights of another
    shape: refused (exit 2) with one line."""
    import ckpt
    from trainer import model as model_mod
    from trainer.config import load_config
    from trainer.train import Trainer, main

    torch.manual_seed(1234)
    initial = model_mod.build(model_mod.model_args("debug")).state_dict()
    ckpt.save({"model": initial}, tmp_path / "init" / "step-00000000", step=0)
    trainer = Trainer(load_config(trainer_args(str(tmp_path / "run"), steps=2, checkpoint__interval=2,
                                        checkpoint__initial_load_path=tmp_path / "init")))
    try:
        loaded = trainer.model.state_dict()
        assert all(torch.equal(loaded[k], initial[k]) for k in initial)  # every weight, bitwise
        assert trainer.loader.position == 0 and trainer.scheduler.last_epoch == 0  # the rest starts fresh
        losses = trainer.fit()
    finally:
        trainer.close()
    assert len(losses) == 2 and all(math.isfinite(l) for l in losses)
    assert "model weights loaded from" in capsys.readouterr().out
    losses, _, loader = run_trainer(trainer_args(str(tmp_path / "run"), steps=3, checkpoint__initial_load_path=tmp_path / "init"))
    assert len(losses) == 1 and loader["position"] == 24  # resumed from its own step 2
    assert "resumed from checkpoint step 2" in capsys.readouterr().out
    for extra, words in (({"checkpoint__initial_load_path": tmp_path / "nothing"}, "neither a checkpoint"),
                         ({"checkpoint__initial_load_path": tmp_path / "init", "model__n_layers": 2}, "do not fit")):
        assert main(trainer_args(str(tmp_path / "other"), steps=1, **extra)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "checkpoint.initial_load_path" in err and words in err


def test_a_person_sees_one_line_per_commit_and_a_summary(tmp_path, capsys):
    from trainer.train import main

    assert main(trainer_args(str(tmp_path), steps=4, checkpoint__enable="true", checkpoint__interval=2)) == 0
    out = capsys.readouterr().out.splitlines()
    from trainer.model import Transformer, model_args, num_params

    with torch.device("meta"):
        debug = num_params(Transformer(model_args("debug", vocab_size=258)))
    assert any(line.startswith(f"training llama/debug ({debug:,} params) on 1 x cpu") for line in out)
    commits = [line for line in out if line.startswith("checkpoint step ")]
    assert [line.split()[2] for line in commits] == ["2", "4"]
    assert all(" committed: full, " in line and str(tmp_path / "checkpoints") in line for line in commits)
    assert all(" MiB in " in line for line in commits)  # one unit family in every line (issue 40 item 6)
    assert out[-1].startswith("run finished: 4 steps in ") and "2 checkpoints written, 2 kept, newest step 4 at " in out[-1]


def test_a_rerun_with_nothing_to_train_says_so_in_one_line_and_writes_nothing(tmp_path, capsys):
    """Issue 40 item 3: resuming step 4 with training.steps = 3 (or 4) trained 0 steps without a word."""
    from trainer.train import main

    args = dict(checkpoint__enable="true", checkpoint__interval=2)
    assert main(trainer_args(str(tmp_path), steps=4, **args)) == 0
    written = {name: (tmp_path / name).read_text() for name in ("metrics.jsonl", "config.json")}
    capsys.readouterr()
    for steps, where in ((3, "past"), (4, "at")):
        assert main(trainer_args(str(tmp_path), steps=steps, **args)) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[-1] == (f"checkpoint step 4 is already {where} training.steps = {steps}: nothing to train; "
                           "raise --training.steps or use another dump folder"), out
        assert not any(line.startswith(("training ", "run finished", "config.json")) for line in out), out
        assert {name: (tmp_path / name).read_text() for name in written} == written  # no record, no config moved
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "config.json", "metrics.jsonl"]


def test_a_resume_with_another_training_lr_says_the_saved_rate_goes_on(tmp_path, capsys):
    """The learning rate comes back with the optimizer's and the scheduler's state (as torchtitan's
    does): a changed ``training.lr`` on a resume did nothing, without a word; one line says so, and the
    step's lr is the saved schedule's. The same rate: no line."""
    import json

    from trainer.train import main

    args = dict(checkpoint__enable="true", checkpoint__interval=2, metrics__log_freq=1)
    assert main(trainer_args(str(tmp_path / "a"), steps=2, **args)) == 0
    assert main(trainer_args(str(tmp_path / "b"), steps=2, **args)) == 0
    capsys.readouterr()
    assert main(trainer_args(str(tmp_path / "a"), steps=3, training__lr=5e-4, **args)) == 0
    changed = capsys.readouterr().out.splitlines()
    assert main(trainer_args(str(tmp_path / "b"), steps=3, **args)) == 0
    same = capsys.readouterr().out.splitlines()
    said = [line for line in changed if line.startswith("training.lr = ")]
    assert said == ["training.lr = 0.0005 is not the resumed run's (0.001): the optimizer and its learning-rate "
                    "schedule go on as saved, at 0.001; a changed rate takes effect only in a new run"], changed
    assert not any(line.startswith("training.lr = ") for line in same), same

    def step_3_lr(run: str) -> float:
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return next(r["lr"] for r in records if r.get("step") == 3 and "lr" in r)

    assert step_3_lr("a") == step_3_lr("b")  # what the line says: the saved rate goes on


def test_the_optimizer_step_returns_the_norm_it_clipped_with():
    """grad_norm in the metrics (issue 40 item 6) is the norm clipping computed, before clipping."""
    from trainer.step import norm_value, optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for max_norm in (1e-3, 0.0):
        model(torch.randn(5, 4)).square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        norm = optimizer_step(list(model.parameters()), optimizer, None, max_norm=max_norm)
        if max_norm:
            assert norm_value(norm) == pytest.approx(expected.item(), rel=1e-6) and expected.item() > 10 * max_norm
        else:
            assert norm is None and norm_value(norm) is None  # nothing clipped: no norm computed

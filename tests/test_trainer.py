"""The trainer end to end on CPU ranks: bitwise resume, resume on another data-parallel degree,
metrics output, seed checkpoint, clean CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import models
from tests.dist import run_ranks

REPO = Path(__file__).resolve().parents[1]


def _args(folder: str, steps: int = 20, **extra) -> list[str]:
    args = ["--config", str(REPO / "configs" / "debug.toml"), "--job.dump_folder", folder,
            "--training.steps", str(steps), "--training.seq_len", "64", "--training.batch_size", "8",
            "--checkpoint.interval", "10", "--metrics.log_freq", "5"]
    for key, value in extra.items():
        args += [f"--{key.replace('__', '.')}", str(value)]
    return args


def _run(argv: list[str], stop_at: int | None = None):
    from trainer.config import load_config
    from trainer.train import Trainer

    trainer = Trainer(load_config(argv))
    try:
        losses = trainer.fit(stop_at=stop_at)
        full = models.full_state(trainer.model, trainer.optimizer)
        return losses, full, trainer.loader.state_dict()
    finally:
        trainer.close()


def _resume_same_layout(rank: int, world: int, root: str):
    straight, straight_state, _ = _run(_args(f"{root}/straight"))
    first, _, _ = _run(_args(f"{root}/resumed"), stop_at=10)
    second, resumed_state, loader = _run(_args(f"{root}/resumed"))
    return straight, first + second, straight_state, resumed_state, loader


def test_resume_is_bitwise_on_two_fsdp_ranks(tmp_path):
    results = run_ranks(2, _resume_same_layout, str(tmp_path))
    straight, resumed, straight_state, resumed_state, loader = results[0]
    assert len(straight) == 20 and resumed == straight  # every step's loss, exactly
    models.assert_same(resumed_state, straight_state)  # final weights and AdamW state, bitwise
    assert loader["position"] == 20 * 8
    assert sum(straight[-5:]) < sum(straight[:5])  # it learns
    lines = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [5, 10, 15, 20]
    assert json.loads((tmp_path / "straight" / "config.json").read_text())["training"]["steps"] == 20
    assert all({"step", "loss", "tokens_per_sec", "ckpt_stall_ms"} <= r.keys() for r in lines)
    steps = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000010", "step-00000020"]


def _train_two_ranks(rank: int, world: int, root: str):
    return _run(_args(f"{root}/two", steps=12))[0], _run(_args(f"{root}/stop", steps=12), stop_at=10)[0]


def test_resume_on_another_data_parallel_degree(tmp_path):
    straight, _ = run_ranks(2, _train_two_ranks, str(tmp_path))[0]
    # One process continues the 2-rank run's step-10 checkpoint: same global samples, so the same
    # losses up to reduction order.
    losses, _, loader = _run(_args(str(tmp_path / "stop"), steps=12))
    assert loader["position"] == 12 * 8
    assert losses == pytest.approx(straight[10:], rel=1e-4)


def test_seed_checkpoint_and_load_step(tmp_path):
    _run(_args(str(tmp_path), steps=20, checkpoint__create_seed_checkpoint="true"))
    assert (tmp_path / "checkpoints" / "step-00000000" / "manifest.json").is_file()
    losses, _, loader = _run(_args(str(tmp_path), steps=4, checkpoint__interval=2))
    assert len(losses) == 4 and loader["position"] == 32  # started from the seed checkpoint (step 0)
    losses, _, loader = _run(_args(str(tmp_path), steps=3, checkpoint__load_step=2))
    assert len(losses) == 1 and loader["position"] == 24  # step 3 only, from step 2's checkpoint
    assert not torch.distributed.is_initialized()  # the trainer closed the group it started


@pytest.mark.parametrize("variant", [
    {"optimization__zero_stage": 0, "training__gradient_accumulation_steps": 2,
     "optimization__gradient_checkpointing": "true"},
    {"optimization__zero_stage": 2, "optimization__precision": "bf16", "training__micro_batch_size": 2},
])
def test_ddp_fsdp_bf16_accumulation_and_activation_checkpointing(tmp_path, variant):
    losses, state, _ = _run(_args(str(tmp_path), steps=6, checkpoint__enable="false", **variant))
    assert len(losses) == 6 and all(l == l and l < 10 for l in losses)
    assert sum(losses[-2:]) < sum(losses[:2])
    assert all(t.dtype == torch.float32 for t in state["model"].values())  # fp32 master weights


def test_cli_errors_are_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "trainer.train", *_args(str(tmp_path)), "--training.bogus", "1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "bogus" in result.stderr
    result = subprocess.run([sys.executable, "-m", "trainer.train", *_args(str(tmp_path)), "--parallelism.tp", "2"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "part 2" in result.stderr

"""Context parallelism (trainer.context_parallel): the load-balanced split, the loader's CP slices,
the config keys; and, on spawned gloo ranks, loss parity of CP 2 (FSDP2, DDP), FSDP 2 x CP 2 and CP 2 x TP 2 with
one process, and a run saved at CP 2 resumed at CP 1 (bitwise state after the reshard)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import models
from tests.support.launch import run_ranks
from tests.support.trainer_runs import run_trainer, trainer_args
from trainer.config import ConfigError, load_config
from trainer.context_parallel import ContextParallelError, chunks, shard_positions
from trainer.data import DataLoader
from trainer.parallel import ParallelDims, ParallelismError

STEPS = 4
TOLERANCE = 1e-5  # absolute, on losses near 5.5 (fp32; reassociation only); measured: see _close's callers
SAVE_AT_2 = {"checkpoint__enable": "true", "checkpoint__interval": 2}


def test_split_is_head_tail_and_covers_the_sequence():
    assert chunks(16, 2, 0) == ((0, 4), (12, 16)) and chunks(16, 2, 1) == ((4, 8), (8, 12))
    for cp in (1, 2, 4):
        held = [p for r in range(cp) for p in shard_positions(16, cp, r)]
        assert sorted(held) == list(range(16))
    with pytest.raises(ContextParallelError, match="divisible by 2 x parallelism.cp"):
        chunks(18, 2, 0)


def test_loader_gives_each_cp_rank_its_columns_and_keeps_its_state():
    tokens = np.arange(2000, dtype=np.int32)
    whole = DataLoader(tokens, 16, 4, seed=3)
    parts = [DataLoader(tokens, 16, 4, seed=3, cp_rank=r, cp_degree=2) for r in range(2)]
    for _ in range(3):
        inputs, labels = whole.next_batch()
        for rank, part in enumerate(parts):
            cols = shard_positions(16, 2, rank)
            got_in, got_labels = part.next_batch()
            assert torch.equal(got_in, inputs[:, cols]) and torch.equal(got_labels, labels[:, cols])
    assert all(part.state_dict() == whole.state_dict() for part in parts)


def test_config_keys_and_refusals():
    assert load_config(["--distributed.cp_size", "2"]).parallelism.cp == 2
    with pytest.raises(ConfigError, match="parallelism.cp=2 is invalid: needs training.seq_len"):
        load_config(["--parallelism.cp", "2", "--training.seq_len", "66"])
    with pytest.raises(ConfigError, match="parallelism.cp=2 is invalid: is not supported with parallelism.pp"):
        load_config(["--parallelism.cp", "2", "--parallelism.pp", "2"])
    dims = ParallelDims.resolve(1, -1, 2, 1, 8, cp=2)
    assert (dims.dp_shard, dims.dp, dims.dp_cp) == (2, 2, 4)
    with pytest.raises(ParallelismError, match=r"cp\(2\)"):
        ParallelDims.resolve(1, 3, 1, 1, 8, cp=2)


def test_dry_run_divides_activations_by_cp_and_adds_the_gathered_keys_values():
    from tests.support import REPO
    from trainer.plan import plan

    base = ["--config", str(REPO / "configs" / "debug.toml"), "--training.seq_len", "1024"]
    one = plan(load_config(base), 1).stages[0].memory["activations"]
    cp2 = plan(load_config([*base, "--parallelism.cp", "2"]), 2)
    assert 0.5 * one < cp2.stages[0].memory["activations"] < 0.6 * one
    assert cp2.layout["cp"] == 2 and "dp_shard 1 x cp 2" in cp2.layout["data_parallel"]


# ---------------------------------------------------------------------------------------------------
# Spawned ranks (slow)

FOUR_RANKS = {
    "fsdp2xcp2": {"parallelism__cp": 2, "parallelism__dp_shard": 2},
    "cp2xtp2": {"parallelism__cp": 2, "parallelism__tp": 2},
}


def _resume_at_2(root, name: str) -> dict:
    """Continue the run ``name`` from its step-2 checkpoint, in another job folder."""
    return {"checkpoint__enable": "true", "checkpoint__interval": 2, "checkpoint__load_step": 2,
            "checkpoint__branch": "true", "checkpoint__folder": f"{root}/{name}/checkpoints"}


def _loaded_then_trained(argv: list[str]):
    """The full state right after the resume, then the losses of the steps that follow."""
    from trainer.train import Trainer

    trainer = Trainer(load_config(argv))
    try:
        loaded = models.full_state(trainer.model, trainer.optimizer)
        return loaded, trainer.fit()
    finally:
        trainer.close()


def _four(rank: int, world: int, root: str) -> dict:
    return {name: run_trainer(trainer_args(f"{root}/{name}", steps=STEPS, **layout))[0]
            for name, layout in FOUR_RANKS.items()}


def _two(rank: int, world: int, root: str) -> dict:
    out = {"cp2": run_trainer(trainer_args(f"{root}/cp2", steps=STEPS, parallelism__cp=2, **SAVE_AT_2))[0],
           "cp2-ddp": run_trainer(trainer_args(f"{root}/cp2-ddp", steps=STEPS, parallelism__cp=2,
                                               optimization__zero_stage=0))[0]}
    # the step-2 checkpoint of the CP 2 run, loaded at CP 2: what the one-process resume must hold
    argv = trainer_args(f"{root}/cp2-loaded", steps=STEPS, parallelism__cp=2, **_resume_at_2(root, "cp2"))
    out["cp2-state-at-2"] = run_trainer(argv, stop_at=2)[1]
    return out


def _close(losses: list[float], reference: list[float]) -> float:
    diff = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    assert diff < TOLERANCE, (losses, reference)
    print(f"max |loss - one process| = {diff:.1e}")  # what TOLERANCE's comment quotes (pytest -s)
    return diff


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.slow
def test_cp_layouts_match_one_process_and_resume_at_cp1(tmp_path):
    """CP 2 (FSDP2 and DDP over the CP ranks), FSDP 2 x CP 2 and CP 2 x TP 2 train as one process does (fp32, within TOLERANCE); the
    step-2 checkpoint of CP 2 loads into one process with the same model and optimizer state, bit for
    bit, and the losses continue as the one-process run's."""
    root = str(tmp_path)
    reference = run_trainer(trainer_args(f"{root}/reference", steps=STEPS))[0]
    two = run_ranks(2, _two, root)[0]
    _close(two["cp2"], reference)
    _close(two["cp2-ddp"], reference)
    four = run_ranks(4, _four, root)[0]
    for name in FOUR_RANKS:
        _close(four[name], reference)
    loaded, losses = _loaded_then_trained(trainer_args(f"{root}/cp1-from-cp2", steps=STEPS, **_resume_at_2(root, "cp2")))
    assert _equal(loaded, two["cp2-state-at-2"])
    _close(losses, reference[2:])

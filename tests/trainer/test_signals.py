"""trainer.signals: a real SIGTERM to a training process stops it after a step, writes that step
(checkpoint.save_on_signal), names the newest committed step and exits 143; the step loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import ckpt
from tests.support import REPO
from tests.support.trainer_runs import trainer_args


def _start(folder, *extra: str) -> subprocess.Popen:
    argv = trainer_args(str(folder), steps=100000, checkpoint__interval=1000, metrics__log_freq=1) + list(extra)
    return subprocess.Popen([sys.executable, "-m", "trainer.train", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _until_step(process: subprocess.Popen, step: int) -> list[str]:
    seen = []
    for line in process.stdout:  # bounded: the run logs every step; a dead process ends the loop
        seen.append(line)
        if line.startswith("step ") and int(line.split()[1]) >= step:
            return seen
    raise AssertionError(f"the run ended before step {step}: {''.join(seen)}{process.stderr.read()}")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_a_step_saves_it_and_names_it(tmp_path, signum):
    process = _start(tmp_path, "--checkpoint.save_on_signal", "true")
    try:
        _until_step(process, 3)
        process.send_signal(signum)
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 128 + signum, err
    last = out.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert last.startswith(f"stopped by {name} after step ") and "(a restart resumes from it)" in last, out
    step = int(last.split("after step ")[1].split(";")[0])
    assert last.endswith(f"newest committed step {step} (a restart resumes from it)")
    assert ckpt.CheckpointRoot(tmp_path / "checkpoints").steps() == [step]
    assert "Traceback" not in err
    end = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])  # after the last save
    assert (end["event"], end["status"], end["last_step"], end["newest_step"]) == ("run_end", "stopped", step, step)


@pytest.mark.slow
def test_branching_from_an_older_step_is_refused_unless_asked(tmp_path, capsys):
    from tests.support.trainer_runs import run_trainer
    from trainer.train import main

    run_trainer(trainer_args(str(tmp_path), steps=30, checkpoint__keep=5))  # steps 10, 20, 30
    assert main(trainer_args(str(tmp_path), steps=30, checkpoint__load_step=10)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the committed steps 20, 30 are newer" in err and "--checkpoint.branch" in err
    assert ckpt.CheckpointRoot(tmp_path / "checkpoints").steps() == [10, 20, 30]  # nothing touched
    assert main(trainer_args(str(tmp_path), steps=20, checkpoint__load_step=10, checkpoint__branch="true")) == 0
    assert "branching from step 10: deleted the later steps 20, 30" in capsys.readouterr().out
    assert ckpt.CheckpointRoot(tmp_path / "checkpoints").steps() == [10, 20]  # one history: 20 is the branch's


def _branch_with_a_late_listing(rank: int, world: int, folder: str) -> list[int]:
    """Two ranks branch from step 2; rank 1 lists the steps only after rank 0 deleted step 4 (the
    order a slow rank sees), so it finds no later step and must still join the deletion."""
    from unittest import mock

    from ckpt.manager import CheckpointManager
    from tests.support.trainer_runs import run_trainer

    layout = {"parallelism__dp_shard": 2, "checkpoint__interval": 2}
    run_trainer(trainer_args(folder, steps=4, **layout))
    listed = CheckpointManager.steps
    late = (lambda self, **kw: [s for s in listed(self, **kw) if s <= 2]) if rank == 1 else listed
    with mock.patch.object(CheckpointManager, "steps", late):
        run_trainer(trainer_args(folder, steps=4, checkpoint__load_step=2, checkpoint__branch="true", **layout))
    return ckpt.CheckpointRoot(f"{folder}/checkpoints").steps()


def test_every_rank_joins_the_branch_even_one_that_lists_no_later_step(tmp_path):
    from tests.support.launch import run_ranks

    assert run_ranks(2, _branch_with_a_late_listing, str(tmp_path)) == [[2, 4], [2, 4]]

"""A second run on a locked checkpoint folder under torchrun (issue 40 item 9): the refusal is said
once, by local rank 0, before torchrun's report of the failed workers, and every rank exits 2.

The lock is rank 0's and its refusal agreed, so every rank raises the same error
(``trainer.exits.refusing_together``); the other ranks stay silent. torchrun's agent sends SIGTERM
to the remaining workers as soon as one has exited, so a worker that would otherwise be a moment
late dies before its line (exit -15 in the report): each holds SIGTERM from the lock on.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ckpt.root import CheckpointRoot
from tests.support import REPO
from tests.support.launch import job_env
from tests.support.trainer_runs import trainer_args
from trainer import exits

LOCKED = "another CheckpointManager is writing to"
HANG_GUARD_S = 600  # not a speed check: far above a loaded box's time for two ranks to be refused


@pytest.mark.slow
def test_a_second_run_under_torchrun_is_refused_in_one_line_before_the_report(tmp_path):
    run = tmp_path / "run"
    holder = CheckpointRoot(run / "checkpoints")
    holder.lock()  # the first run, still writing
    try:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "-m", "trainer.train", *trainer_args(str(run), steps=4)],
            cwd=REPO, env=job_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=HANG_GUARD_S)
    finally:
        holder.unlock()
    err = result.stderr
    assert result.returncode != 0, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and LOCKED in errors[0] and "lock held by" in errors[0], err
    report = err.index("ChildFailedError")  # torchrun's report of the failed workers follows its traceback
    assert err.index(errors[0]) < err.index("Traceback") < report, err
    assert sorted(re.findall(r"exitcode\s*:\s*(-?\d+)", err[report:])) == ["2", "2"], err
    assert not (run / "config.json").exists()  # refused before anything was written


@pytest.mark.parametrize("local_rank, said", [("0", True), ("1", False)])
def test_a_refusal_every_rank_shares_is_said_by_local_rank_0_only(local_rank, said, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", local_rank)

    def locked():
        with exits.refusing("checkpoint.folder='x'", alike=(OSError,)):
            raise OSError("locked")

    assert exits.run(locked) == exits.REFUSED
    assert capsys.readouterr().err == ("error: checkpoint.folder='x': locked\n" if said else "")


def test_a_refusal_of_this_rank_alone_is_said_by_every_rank(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "1")

    def refused():
        with exits.refusing("job.dump_folder='x'", alike=(PermissionError,)):
            raise FileNotFoundError("no such folder")

    assert exits.run(refused) == exits.REFUSED
    assert capsys.readouterr().err == "error: job.dump_folder='x': no such folder\n"

"""The trainer's start over a folder whose newest step cannot be loaded: damaged on every mount, it
is set aside and the run resumes from the step before (exit 0, the same losses as a run that never
had it); merely unreadable now (a mount that fails), the run stops with exit 1 and one line rather
than train over it."""

from __future__ import annotations

import warnings

import pytest

import ckpt
from ckpt.errors import StorageError
from tests.support.checkpoints import flip_byte
from tests.support.trainer_runs import logged_losses, run_trainer, trainer_args

pytestmark = pytest.mark.slow  # three short single-process trainer runs


def test_a_newest_step_damaged_everywhere_is_set_aside_and_trained_again(tmp_path, capsys):
    from trainer.train import main

    reference = tmp_path / "reference"
    run_trainer(trainer_args(str(reference), steps=30, metrics__log_freq=1))
    run = tmp_path / "run"
    run_trainer(trainer_args(str(run), steps=30, metrics__log_freq=1))  # steps 10, 20, 30
    flip_byte(run / "checkpoints" / "step-00000030", largest=True)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(trainer_args(str(run), steps=30, metrics__log_freq=1)) == 0
    out = capsys.readouterr().out
    assert "resumed from checkpoint step 20" in out
    assert ckpt.CheckpointRoot(run / "checkpoints").steps() == [10, 20, 30]  # a fresh step 30
    assert len(list((run / "checkpoints").glob("step-00000030.damaged-*"))) == 1
    assert logged_losses(run) == logged_losses(reference)  # steps 21-30 trained again, bitwise


def test_a_newer_step_that_cannot_be_read_now_stops_the_run(tmp_path, capsys, monkeypatch):
    import ckpt.manager
    from trainer.train import main

    run_trainer(trainer_args(str(tmp_path), steps=20))  # steps 10, 20
    real = ckpt.manager.load_with_manifest

    def flaky(state, path, *args, **kwargs):
        if path.name == "step-00000020":
            raise StorageError(f"{path}: connection reset by peer")
        return real(state, path, *args, **kwargs)

    monkeypatch.setattr(ckpt.manager, "load_with_manifest", flaky)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(trainer_args(str(tmp_path), steps=30)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the committed steps 20 are newer and could not be loaded now" in err
    assert ckpt.CheckpointRoot(tmp_path / "checkpoints").steps() == [10, 20]  # nothing set aside or replaced
    assert not list((tmp_path / "checkpoints").glob("*.damaged-*"))

"""ckpt.root.claim: every mount a manager writes is claimed for one run — two runs replicating into
one directory, a replica that is another run's locked primary, a run that lost its primary resuming
from its own replica (never another run's step), a replica that can never be written (issue 22,
items 1, 2 and 4)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import torch

import ckpt
from ckpt.root import CheckpointRoot
from tests.support.checkpoints import assert_state_equal, step_path
from tests.support.replicas import FAST_RETRY
from tests.support.replicas import blank as _blank
from tests.support.replicas import train as _train


def _wait_states(manager, steps, states=("committed",), timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = manager.replication_status()
        if all(step in status and all(s in states for s in status[step].values()) for step in steps):
            return status
        time.sleep(0.05)
    raise AssertionError(f"replication did not settle: {manager.replication_status()}")


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in (".lock",) and ".catalog" not in p.parts}


def _run_of(root) -> str:
    return json.loads((root / ".run").read_text())["run"]


def test_two_runs_replicating_into_one_directory_never_touch_each_others_steps(tmp_path, caplog):
    a, b, shared = tmp_path / "a", tmp_path / "b", tmp_path / "shared"
    with ckpt.CheckpointManager(a, interval=1, keep=3, replicas=[str(shared)], **FAST_RETRY) as run_a:
        saved_a = _train(run_a, [1, 2, 3, 4, 5, 6])
        run_a.wait()
        _wait_states(run_a, [4, 5, 6])
    copies_of_a = _files(shared)
    caplog.set_level(logging.INFO, logger="ckpt")
    with ckpt.CheckpointManager(b, interval=1, keep=3, replicas=[str(shared)], **FAST_RETRY) as run_b:
        _train(run_b, [7, 8, 9], seed0=100)
        run_b.wait()
        status = _wait_states(run_b, [7, 8, 9], states=("refused",))
    assert CheckpointRoot(shared).committed() == [4, 5, 6]  # B's retention deleted none of A's copies
    assert _files(shared) == copies_of_a  # and B wrote nothing there
    assert all(state == "refused" for states in status.values() for state in states.values())
    refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "refused" in r.getMessage()]
    assert len(refusals) == 1 and _run_of(a) in refusals[0] and _run_of(b) in refusals[0]

    # The worst case besides: one of B's steps lands in the shared directory anyway (copied by hand).
    shutil.copytree(step_path(b, 9), step_path(shared, 9))
    shutil.rmtree(a)  # A loses its primary, restarts on the same paths
    caplog.clear()
    with ckpt.CheckpointManager(a, interval=1, keep=3, replicas=[str(shared)], **FAST_RETRY) as run_a:
        live = _blank()
        with pytest.warns(UserWarning, match="loaded from replica"):
            assert run_a.load(live) == 6  # its own newest step, not B's step 9
        assert_state_equal(live, saved_a[6])
        assert run_a.run == _run_of(shared)  # the run continues: its replica names this very primary
    foreign = [r.getMessage() for r in caplog.records if "another run" in r.getMessage()]
    assert len(foreign) == 1 and _run_of(b) in foreign[0] and _run_of(a) in foreign[0] and "9" in foreign[0]


def test_a_replica_that_is_another_runs_locked_primary_is_never_written(tmp_path, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(b, interval=1) as run_b:  # B holds its root's lock all along
        _train(run_b, [3, 4], seed0=50)
        run_b.wait()
        before = _files(b)
        with ckpt.CheckpointManager(a, interval=1, keep=2, replicas=[str(b)], **FAST_RETRY) as run_a:
            _train(run_a, [1, 2, 3, 4, 5])
            run_a.wait()
            _wait_states(run_a, [1, 2, 3, 4, 5], states=("refused", "failed"))
            time.sleep(0.5)  # retries, if any, would have written by now
        assert _files(b) == before  # B's committed steps 3 and 4 neither replaced nor deleted
        assert run_b.steps() == [3, 4]


def test_a_replica_claimed_by_another_run_is_refused_naming_both_runs(tmp_path, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(b, interval=1) as run_b:
        _train(run_b, [3, 4], seed0=50)
    before = _files(b)
    caplog.set_level(logging.INFO, logger="ckpt")
    with ckpt.CheckpointManager(a, interval=1, keep=2, replicas=[str(b)], **FAST_RETRY) as run_a:
        _train(run_a, [1, 2, 3])
        run_a.wait()
        status = _wait_states(run_a, [1, 2, 3], states=("refused",))
        live = _blank()
        assert run_a.load(live) == 3  # its own, from its primary
    assert _files(b) == before
    assert {state for states in status.values() for state in states.values()} == {"refused"}
    refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refusals) == 1 and _run_of(a) in refusals[0] and _run_of(b) in refusals[0]


def test_each_step_records_its_run_and_older_manifests_without_one_still_load(tmp_path):
    with ckpt.CheckpointManager(tmp_path / "run", interval=1) as manager:
        manager.save(1, {"x": torch.ones(3)})
        run = manager.run
    assert ckpt.read_manifest(step_path(tmp_path / "run", 1)).run == run == _run_of(tmp_path / "run")
    ckpt.save({"x": torch.ones(3)}, tmp_path / "plain")  # not a run's: no run recorded
    raw = (tmp_path / "plain" / "manifest.json").read_bytes()
    assert b'"run"' not in raw and ckpt.read_manifest(tmp_path / "plain").run is None
    live = {"x": torch.zeros(3)}
    ckpt.load(live, tmp_path / "plain")
    assert torch.equal(live["x"], torch.ones(3))


def test_a_replica_that_can_never_be_written_is_refused_up_front(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    for replica in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(ckpt.InvalidOptionError, match="is not a directory.*can never work"):
            ckpt.CheckpointManager(tmp_path / "run", replicas=[str(replica)])
    with ckpt.CheckpointManager(tmp_path / "run", replicas=[str(tmp_path / "not-there-yet")]):
        pass  # a replica still to be created (or a mount that is down) does not block start-up
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ckpt.InvalidOptionError, match="not writable"):
            ckpt.CheckpointManager(tmp_path / "run", replicas=[str(locked)])

"""ckpt.root.retention: which steps a policy deletes, retention on disk through CheckpointManager, and
retention keeping every base a retained delta needs."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.root import retention
from ckpt.manager import CheckpointManager
from ckpt.root import committed_steps
from tests.support.chains import train_with_chain as _train_with_chain


def test_retention_policy():
    assert retention.steps_to_delete([1, 2, 3, 4, 5], keep=2) == [1, 2, 3]
    assert retention.steps_to_delete([10, 20, 30, 40, 50], keep=1, keep_every=20) == [10, 30]
    assert retention.steps_to_delete([1, 2, 3], keep=1, protected={1}) == [2]
    with pytest.raises(ValueError):
        retention.steps_to_delete([1], keep=0)


def test_retention_on_disk(tmp_path):
    with CheckpointManager(tmp_path, interval=1, keep=2, keep_every=4) as manager:
        for step in range(1, 11):
            manager.save(step, {"x": torch.full((3,), float(step)), "step": step})
    assert committed_steps(tmp_path) == [4, 8, 9, 10]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".catalog", ".lock", ".run"] + [f"step-{s:08d}" for s in (4, 8, 9, 10)]


def test_retention_keeps_what_retained_deltas_need(tmp_path):
    assert retention.steps_to_delete([1, 2, 3, 4, 5], keep=1, bases={2: 1, 3: 2, 4: None, 5: 4}) == [1, 2, 3]
    assert retention.steps_to_delete([1, 2, 3], keep=1, bases={2: 1, 3: 2}) == []
    _train_with_chain(tmp_path, steps=6, full_every=3)  # 1 full, 2-3 deltas, 4 full, 5-6 deltas
    with CheckpointManager(tmp_path, keep=1) as manager:
        manager.save(7, {"x": torch.ones(1)}, force=True)  # a full of another layout triggers retention
    assert committed_steps(tmp_path) == [7]
    _train_with_chain(tmp_path / "b", steps=5, full_every=3, keep=1)
    assert committed_steps(tmp_path / "b") == [4, 5]  # 5 is a delta on 4


def test_retention_deletes_dependents_first(tmp_path, monkeypatch):
    """A crash between two deletions must not leave a listed delta whose base is gone: the newest
    doomed step goes first. Provoked: the run dies (here: raises) after the first deletion."""
    from ckpt.root import CheckpointRoot
    from tests.support.checkpoints import step_path

    deleted = []
    original = CheckpointRoot.delete

    def delete_then_die(root, step):
        original(root, step)
        deleted.append(step)
        raise RuntimeError("killed between two deletions")

    with CheckpointManager(tmp_path, full_every=3, keep=10) as manager:
        for step in (1, 2, 3, 4):  # 1 full, 2 and 3 deltas, 4 full
            manager.save(step, {"w": torch.full((64,), float(step))})
    monkeypatch.setattr(CheckpointRoot, "delete", delete_then_die)
    with pytest.raises(ckpt.CheckpointWriteError, match="killed between"):
        with CheckpointManager(tmp_path, keep=1) as manager:
            manager.save(5, {"w": torch.full((64,), 5.0)})
    assert deleted == [4]  # 5 kept; doomed 4, 3, 2, 1: the newest first
    root = CheckpointRoot(tmp_path)
    listed = root.steps()
    bases = root.bases(listed)
    assert listed == [1, 2, 3, 5]
    assert all(bases[s] is None or bases[s] in listed for s in listed)
    for step in listed:
        ckpt.load({"w": torch.zeros(64)}, step_path(tmp_path, step))


def test_apply_is_one_mounts_retention_newest_first(tmp_path):
    """What the manager runs on the primary and the replicator on every replica: the mount's listing,
    its bases and those of the steps in flight, deletions newest first, each one told."""
    from ckpt.root import CheckpointRoot

    with CheckpointManager(tmp_path, full_every=3, keep=10) as manager:
        for step in (1, 2, 3, 4, 5):  # 1 full, 2-3 deltas, 4 full, 5 a delta on 4
            manager.save(step, {"w": torch.full((64,), float(step))})
    root, told = CheckpointRoot(tmp_path), []
    assert retention.apply(root, keep=1, protected={6}, bases_in_flight={6: 2}, deleted=told.append) == [3]
    assert told == [3] and root.steps() == [1, 2, 4, 5]  # 5 needs 4; 6 (being written) builds on 2, 2 on 1
    assert retention.apply(root, keep=1, deleted=told.append) == [1, 2]
    assert told == [3, 2, 1] and root.steps() == [4, 5] == committed_steps(tmp_path)


def test_a_branch_is_finished_on_every_mount_or_the_error_names_what_is_left(tmp_path, monkeypatch):
    """Issue 36 item 5: a replica whose deletion fails kept steps 4-6 of the old branch while the
    primary lost them (a later resume from the replica would take the abandoned branch). Every mount
    is tried, the failure names the mount and step, the primary keeps its later steps (no replica is
    newer than its history), and branching again once the mount works finishes the job."""
    from ckpt.root import CheckpointRoot

    primary, bad, good = tmp_path / "primary", tmp_path / "bad", tmp_path / "good"
    with CheckpointManager(primary, interval=1, keep=10, full_every=3, replicas=[str(bad), str(good)]) as manager:
        for step in range(1, 7):
            manager.save(step, {"w": torch.full((16,), float(step))})
    assert CheckpointRoot(bad).steps() == CheckpointRoot(good).steps() == [1, 2, 3, 4, 5, 6]
    original = CheckpointRoot.delete
    deleted_on_good = []

    def failing_on_bad(root, step):
        if str(root.path) == str(bad):
            raise ckpt.StorageError(f"{root.path}: permission denied", path=str(root.path))
        original(root, step)
        if str(root.path) == str(good):
            deleted_on_good.append(step)

    monkeypatch.setattr(CheckpointRoot, "delete", failing_on_bad)
    with CheckpointManager(primary, interval=1, keep=10, replicas=[str(bad), str(good)]) as manager:
        with pytest.raises(ckpt.CheckpointError) as info:
            manager.discard_after(3)
        assert f"{bad}: step 6 not deleted" in str(info.value) and "permission denied" in str(info.value)
        assert manager.steps() == [1, 2, 3, 4, 5, 6]  # the primary last: still the whole history
    assert sorted(deleted_on_good) == [4, 5, 6], str(info.value)  # tried although the other replica failed
    # no replica is newer than the primary's history (the replicator may copy 4-6 back to the good
    # one, since the primary still holds them: that is the primary's history, not another branch)
    assert set(CheckpointRoot(good).steps()) <= {1, 2, 3, 4, 5, 6}
    assert CheckpointRoot(bad).steps() == [1, 2, 3, 4, 5, 6]
    monkeypatch.setattr(CheckpointRoot, "delete", original)
    with CheckpointManager(primary, keep=10, replicas=[str(bad), str(good)]):
        pass  # its close lets the catch-up finish: the good replica holds the primary's 4-6 again
    assert CheckpointRoot(good).steps() == [1, 2, 3, 4, 5, 6]  # (so no copy races the branch below)
    with CheckpointManager(primary, interval=1, keep=10, replicas=[str(bad), str(good)]) as manager:
        assert manager.discard_after(3) == [4, 5, 6]  # the same branch again: finished
    assert [CheckpointRoot(m).steps() for m in (primary, bad, good)] == [[1, 2, 3]] * 3

"""ckpt.root.steps: step naming, the committed steps, start-up clean-up and the delta base map."""

from __future__ import annotations

import pytest
import torch

import ckpt
from ckpt.format import step_name
from ckpt.root import CheckpointRoot, committed_steps
from tests.support.checkpoints import step_path


def test_step_names_and_only_committed_steps_are_listed(tmp_path):
    assert step_name(7) == "step-00000007" and step_path(tmp_path, 123456789).name == "step-123456789"
    for step in (3, 10):
        ckpt.save({"x": torch.ones(2)}, step_path(tmp_path, step))
    (tmp_path / "step-00000004").mkdir()  # no manifest: a deletion interrupted, not a checkpoint
    (tmp_path / "step-00000005.tmp-0123456789ab").mkdir()
    (tmp_path / "step-6").mkdir()  # not our naming
    (tmp_path / "notes.txt").write_text("hi")
    assert committed_steps(tmp_path) == [3, 10] == CheckpointRoot(tmp_path).steps()
    assert committed_steps(tmp_path / "missing") == []


def test_lock_cleans_up_and_is_exclusive(tmp_path):
    ckpt.save({"x": torch.ones(2)}, step_path(tmp_path, 1))
    (tmp_path / "step-00000002" / "data").mkdir(parents=True)
    (tmp_path / "step-00000003.tmp-0123456789ab" / "data").mkdir(parents=True)
    root = CheckpointRoot(tmp_path)
    root.lock()
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "step-00000001"]
        with pytest.raises(ckpt.CheckpointLockedError):
            CheckpointRoot(tmp_path).lock()
    finally:
        root.unlock()
    other = CheckpointRoot(tmp_path)
    other.lock()
    other.unlock()


def test_bases_read_from_manifests(tmp_path):
    with ckpt.CheckpointManager(tmp_path, full_every=3, keep=10) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, {"w": torch.full((64,), float(step))})
    root = CheckpointRoot(tmp_path)  # a new process: nothing recorded, the manifests tell
    assert root.bases([1, 2, 3, 4]) == {1: None, 2: 1, 3: 2, 4: None}
    root.delete(4)
    assert root.steps() == [1, 2, 3]


def test_a_delta_whose_base_lost_its_manifest_is_not_listed(tmp_path):
    """Start-up clean-up deletes a step directory without a manifest; the deltas built on it can
    never load, so they are not offered (they used to be listed, and loading them failed)."""
    with ckpt.CheckpointManager(tmp_path, full_every=3, keep=10) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, {"w": torch.full((64,), float(step))})
    (step_path(tmp_path, 1) / "manifest.json").unlink()  # 2 and 3 are deltas on 1 (and 2)
    assert CheckpointRoot(tmp_path).committed() == [2, 3, 4]
    assert committed_steps(tmp_path) == [4]
    with ckpt.CheckpointManager(tmp_path) as manager:  # start-up clean-up removes step 1's files
        assert manager.steps() == [4]
        assert manager.load({"w": torch.zeros(64)}) == 4
    (step_path(tmp_path, 4) / "manifest.json").unlink()  # now the newest loadable-looking steps are orphans
    with ckpt.CheckpointManager(tmp_path) as manager, pytest.warns(UserWarning, match="step [23] cannot be loaded"):
        with pytest.raises(ckpt.CorruptCheckpointError, match="no checkpoint .* can be loaded"):
            manager.load({"w": torch.zeros(64)})


def test_two_managers_on_one_root_the_second_is_refused_naming_the_holder(tmp_path):
    import os

    with ckpt.CheckpointManager(tmp_path / "run"):
        with pytest.raises(ckpt.CheckpointLockedError, match=f"host .* pid {os.getpid()}"):
            ckpt.CheckpointManager(tmp_path / "run")


def test_a_step_whose_rest_goes_with_a_concurrent_clean_up_is_deleted_not_an_error(tmp_path, monkeypatch):
    """A branch's deletion removes the manifest first; the run's start-up clean-up (a replica's,
    in the replicator's thread) may then take the manifest-less directory before the deletion's
    directory fsync. Found under load (-n 2): the branch failed with ENOENT for a step that was gone."""
    from ckpt.storage.local import LocalStorage

    for step in (1, 2):
        ckpt.save({"x": torch.ones(2)}, step_path(tmp_path, step))
    root = CheckpointRoot(tmp_path)
    remove = LocalStorage.remove

    def remove_then_clean_up(storage, path):
        remove(storage, path)
        if path.endswith("manifest.json") and "step-00000002" in path:
            import shutil
            shutil.rmtree(tmp_path / "step-00000002")  # what collect_uncommitted does meanwhile

    monkeypatch.setattr(LocalStorage, "remove", remove_then_clean_up)
    root.delete(2)
    assert root.steps() == [1] and not (tmp_path / "step-00000002").exists()

"""ckpt.root.damaged and the resume around it: a step damaged on every mount holding it is set aside
(renamed ``step-N.damaged-<time>``, never deleted) on each, the run resumes from the newest step that
loads, and the step can be written again; every rank decides alike. A step that only failed because a
mount could not be read, or that loads from another mount, stays where it is."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import ckpt
from ckpt.errors import StorageError
from ckpt.format import parse_damaged_name
from ckpt.root import CheckpointRoot, resume
from ckpt.root.damaged import damaged_steps, set_aside
from ckpt.storage import locate
from tests.support.checkpoints import assert_state_equal, flip_byte, step_path
from tests.support.launch import run_ranks
from tests.support.replicas import FAST_RETRY, blank, train


def _damage(root: Path, step: int) -> None:
    flip_byte(step_path(root, step), largest=True)


def _aside(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if parse_damaged_name(p.name) is not None)


def test_a_step_damaged_on_every_mount_is_set_aside_there_and_written_again(tmp_path):
    primary, replica = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(primary, interval=1, keep=9, full_every=3, replicas=[str(replica)],
                                **FAST_RETRY) as manager:
        saved = train(manager, [1, 2, 3, 4])
    for root in (primary, replica):
        _damage(root, 4)
    kept = {root: sorted(p.read_bytes() for p in (step_path(root, 4) / "data").iterdir()) for root in (primary, replica)}
    with ckpt.CheckpointManager(primary, interval=1, keep=9, full_every=3, replicas=[str(replica)],
                                **FAST_RETRY) as manager:
        live = blank()
        with pytest.warns(UserWarning, match="step 4 cannot be loaded"):
            assert manager.load(live) == 3
        assert_state_equal(live, saved[3])
        assert manager.steps() == [1, 2, 3] and manager.steps(agreed=True) == [1, 2, 3]
        for root in (primary, replica):
            (aside,) = _aside(root)  # moved, bytes and manifest kept for a person to look at
            assert parse_damaged_name(aside.name)[0] == 4 and (aside / "manifest.json").is_file()
            assert sorted(p.read_bytes() for p in (aside / "data").iterdir()) == kept[root]
            assert damaged_steps(locate(root)) == [(4, aside.name)]
        live["step"] = 4
        manager.save(4, live)  # training through step 4 again writes a fresh one
    assert CheckpointRoot(primary).steps() == [1, 2, 3, 4]
    restored = blank()
    ckpt.load(restored, step_path(primary, 4))
    assert_state_equal(restored, live)
    assert len(_aside(primary)) == 1  # and the set-aside copy stays


def test_ckpt_inspect_lists_the_steps_set_aside(tmp_path, capsys):
    from tools.inspection import main

    with ckpt.CheckpointManager(tmp_path, interval=1, keep=9) as manager:
        train(manager, [1, 2])
    _damage(tmp_path, 2)
    with ckpt.CheckpointManager(tmp_path) as manager, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert manager.load(blank()) == 1
    (aside,) = _aside(tmp_path)
    capsys.readouterr()
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"set aside, no mount could load it: step 2 as {aside.name} on {tmp_path}" in out
    assert main([str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [row["step"] for row in doc["steps"]] == [1]
    assert doc["damaged"] == [{"mount": str(tmp_path), "step": 2, "name": aside.name}]


def test_a_step_that_loads_from_a_replica_is_not_set_aside(tmp_path):
    primary, replica = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(primary, interval=1, keep=9, replicas=[str(replica)], **FAST_RETRY) as manager:
        saved = train(manager, [1, 2])
    _damage(primary, 2)
    with ckpt.CheckpointManager(primary, replicas=[str(replica)], **FAST_RETRY) as manager:
        live = blank()
        with pytest.warns(UserWarning, match="loaded from replica"):
            assert manager.load(live) == 2
        assert_state_equal(live, saved[2])
    assert _aside(primary) == [] and _aside(replica) == []


def test_a_step_that_failed_for_an_unreadable_mount_is_not_set_aside(tmp_path):
    primary, replica = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(primary, interval=1, keep=9, replicas=[str(replica)], **FAST_RETRY) as manager:
        saved = train(manager, [1, 2])
    _damage(primary, 2)  # damaged on the primary; the replica's copy cannot be read just now

    def load(state, path, mirrors):
        if str(path).startswith(str(replica)):
            raise StorageError(f"{path}: connection reset")
        ckpt.load(state, path)

    mounts = [CheckpointRoot(primary), CheckpointRoot(replica)]
    live = blank()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert resume.load_latest(mounts, live, load) == 1
    assert_state_equal(live, saved[1])
    assert _aside(primary) == [] and _aside(replica) == []  # not known to be lost: it stays
    assert CheckpointRoot(primary).committed() == [1, 2]


def test_an_explicit_step_that_is_damaged_fails_and_stays(tmp_path):
    with ckpt.CheckpointManager(tmp_path, interval=1, keep=9) as manager:
        train(manager, [1, 2])
    _damage(tmp_path, 2)
    with ckpt.CheckpointManager(tmp_path) as manager:
        with pytest.raises(ckpt.CorruptCheckpointError):
            manager.load(blank(), step=2)
    assert _aside(tmp_path) == [] and CheckpointRoot(tmp_path).committed() == [1, 2]


def test_set_aside_on_an_object_store_copies_then_deletes_manifest_first(s3_bucket, tmp_path):
    url = f"{s3_bucket.url}/run"
    options = s3_bucket.storage_options
    with ckpt.CheckpointManager(url, interval=1, keep=9, storage_options=options) as manager:
        saved = train(manager, [1, 2])
    root = locate(url, options)
    where = set_aside(root, 2, "20261205T130501Z")
    assert where is not None and where.name == "step-00000002.damaged-20261205T130501Z"
    assert CheckpointRoot(url, options).committed() == [1]
    assert damaged_steps(root) == [(2, where.name)]
    restored = blank()
    ckpt.load(restored, where, storage_options=options)  # every object came along, bitwise
    assert_state_equal(restored, saved[2])
    second = set_aside(root, 1, "20261205T130501Z")
    assert second.name == "step-00000001.damaged-20261205T130501Z"
    assert set_aside(root, 1, "20261205T130501Z") is None  # no longer committed: nothing to move


def _two_ranks_resume(rank: int, world: int, root: str) -> tuple[int, list[int], list[str]]:
    with ckpt.CheckpointManager(root, interval=1, keep=9, full_every=3) as manager:
        train(manager, [1, 2, 3, 4, 5, 6])
    if rank == 0:
        _damage(Path(root), 6)
    torch_barrier()
    with ckpt.CheckpointManager(root, interval=1, keep=9, full_every=3) as manager:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = manager.load(blank())
        steps = manager.steps(agreed=True)
    return loaded, steps, [p.name for p in _aside(Path(root))]


def torch_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.slow
def test_every_rank_falls_back_together_and_one_sets_the_step_aside(tmp_path):
    results = run_ranks(2, _two_ranks_resume, str(tmp_path / "run"))
    loaded, steps, aside = results[0]
    assert loaded == 5 and steps == [1, 2, 3, 4, 5] and len(aside) == 1
    assert results[1] == results[0]  # the same decision on both ranks

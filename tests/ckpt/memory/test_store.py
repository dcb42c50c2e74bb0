"""NodeStore, one node's memory directory for one run: private directories (0700, this user's, no
links), refusals, committed rank checkpoints counted and leftovers not, COMPLETE read bounded and
checked, start-up clean-up, retention and a clean finish that never touch another run's directory
or anything else in ours."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.errors import CheckpointNotFoundError, CheckpointWriteError, InvalidOptionError, UnsafeCheckpointError
from ckpt.memory.store import COMPLETE_NAME, MAX_COMPLETE_BYTES, NodeStore, memory_steps

RUN, OTHER = "run-a", "run-b"


def _save_rank(store: NodeStore, step: int, rank: int) -> None:
    store.prepare_step(step)
    ckpt.save({"w": torch.arange(8, dtype=torch.float32) + rank}, store.rank_location(step, rank), no_dist=True)


def _complete_step(store: NodeStore, step: int, ranks=(0, 1)) -> None:
    for rank in ranks:
        _save_rank(store, step, rank)
    store.mark_complete(step, ranks)


def _write_complete(store: NodeStore, step: int, record) -> None:
    raw = record if isinstance(record, bytes) else json.dumps(record).encode()
    (store.step_dir(step) / COMPLETE_NAME).write_bytes(raw)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_directories_are_private_and_named_as_laid_out(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN, node=1)
    assert store.path == tmp_path / "mem" / RUN
    assert _mode(tmp_path / "mem") == 0o700 and _mode(store.path) == 0o700
    assert store.step_dir(12) == store.path / "step-00000012"
    assert Path(store.rank_location(12, 3).path) == store.path / "step-00000012" / "rank-00003"
    store.prepare_step(12)
    assert store.step_dir(12).is_dir()
    assert store.free_bytes() == os.statvfs(store.path).f_bavail * os.statvfs(store.path).f_frsize > 0


def test_an_existing_memory_directory_keeps_its_mode(tmp_path):
    (tmp_path / "mem").mkdir(mode=0o755)
    os.chmod(tmp_path / "mem", 0o755)
    store = NodeStore(tmp_path / "mem", RUN)
    assert _mode(tmp_path / "mem") == 0o755 and _mode(store.path) == 0o700


@pytest.mark.parametrize("where", ["directory", "run"])
def test_a_symbolic_link_is_refused(tmp_path, where):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    if where == "directory":
        (tmp_path / "mem").symlink_to(real)
    else:
        (tmp_path / "mem").mkdir(mode=0o700)
        (tmp_path / "mem" / RUN).symlink_to(real)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        NodeStore(tmp_path / "mem", RUN)
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("where", ["directory", "run"])
def test_a_file_in_place_of_a_directory_is_refused(tmp_path, where):
    (tmp_path / "mem").mkdir(mode=0o700)
    target = tmp_path / "mem" if where == "directory" else tmp_path / "mem" / RUN
    if where == "directory":
        target.rmdir()
    target.write_text("x")
    with pytest.raises(UnsafeCheckpointError, match="not a directory"):
        NodeStore(tmp_path / "mem", RUN)


def test_a_run_directory_open_to_others_is_refused(tmp_path):
    (tmp_path / "mem" / RUN).mkdir(parents=True)
    os.chmod(tmp_path / "mem" / RUN, 0o750)
    with pytest.raises(UnsafeCheckpointError, match="open to other users"):
        NodeStore(tmp_path / "mem", RUN)


@pytest.mark.parametrize("where", ["directory", "run"])
def test_another_users_directory_is_refused(tmp_path, monkeypatch, where):
    NodeStore(tmp_path / "mem", RUN)
    owner = os.lstat(tmp_path / "mem").st_uid
    if where == "run":  # the memory directory stays ours: only the run's is another user's
        real_lstat = os.lstat
        monkeypatch.setattr(os, "lstat", lambda path, **kw: _owned_by(real_lstat(path, **kw), owner + 1)
                            if Path(path).name == RUN else real_lstat(path, **kw))
    else:
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    with pytest.raises(UnsafeCheckpointError, match="belongs to uid"):
        NodeStore(tmp_path / "mem", RUN)


def _owned_by(info: os.stat_result, uid: int) -> os.stat_result:
    fields = list(info)
    fields[stat.ST_UID] = uid
    return os.stat_result(fields)


def test_a_bad_run_id_is_refused(tmp_path):
    with pytest.raises(InvalidOptionError):
        NodeStore(tmp_path / "mem", "../escape")
    assert not (tmp_path / "mem").exists() and not (tmp_path / "escape").exists()


def test_a_committed_rank_counts_and_a_leftover_does_not(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN)
    _save_rank(store, 5, 0)
    leftover = store.step_dir(5) / "rank-00001.tmp-0123456789ab"
    (leftover / "data").mkdir(parents=True)
    (leftover / "manifest.json").write_text("{}")  # even with a manifest: a name not made by the store
    (store.step_dir(5) / "rank-2").mkdir()  # not five digits
    (store.step_dir(5) / "rank-2" / "manifest.json").write_text("{}")
    (store.step_dir(5) / "rank-00004" / "data").mkdir(parents=True)  # no manifest: an interrupted removal
    ckpt.save({"w": torch.zeros(2)}, str(tmp_path / "outside"), no_dist=True)
    (store.step_dir(5) / "rank-00003").symlink_to(tmp_path / "outside")  # committed, but through a link
    assert store.committed_ranks(5) == {0}
    with pytest.raises(CheckpointWriteError, match="not committed"):
        store.mark_complete(5, [0, 1])
    assert not (store.step_dir(5) / COMPLETE_NAME).exists()


def test_complete_is_written_atomically_and_listed(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN, node=2)
    _complete_step(store, 7, ranks=(0, 1))
    record = json.loads((store.step_dir(7) / COMPLETE_NAME).read_text())
    assert record == {"run": RUN, "step": 7, "node": 2, "ranks": [0, 1]}
    assert sorted(os.listdir(store.step_dir(7))) == [COMPLETE_NAME, "rank-00000", "rank-00001"]  # no tmp left
    assert store.complete_steps() == {7: {0, 1}}
    (described,) = store.describe()
    assert described["step"] == 7 and described["node"] == 2 and described["ranks"] == [0, 1]
    on_disk = sum(f.stat().st_size for rank in ("rank-00000", "rank-00001")
                  for f in (store.step_dir(7) / rank).rglob("*") if f.is_file())
    assert described["bytes"] == on_disk > 0
    assert memory_steps(tmp_path / "mem", RUN) == [described]


def test_memory_steps_creates_nothing(tmp_path):
    assert memory_steps(tmp_path / "mem", RUN) == []
    assert not (tmp_path / "mem").exists()


def test_an_incomplete_step_is_never_listed_and_is_removed_at_start_up(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN)
    _complete_step(store, 3)
    _save_rank(store, 4, 0)  # never marked complete
    assert store.complete_steps() == {3: {0, 1}} and [d["step"] for d in store.describe()] == [3]
    assert store.retain(0, protect=[3]) == []  # retention never touches a step being written
    assert store.step_dir(4).is_dir()
    assert store.remove_incomplete() == [4]
    assert not store.step_dir(4).exists() and store.complete_steps() == {3: {0, 1}}


def test_start_up_removes_leftovers_inside_a_complete_step(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN)
    _complete_step(store, 3)
    (store.step_dir(3) / "rank-00001.tmp-0123456789ab" / "data").mkdir(parents=True)
    (store.step_dir(3) / f"{COMPLETE_NAME}.tmp-0123456789ab").write_text("{")
    (store.step_dir(3) / "notes.txt").write_text("a person's")
    (store.step_dir(3) / "notes.txt.tmp-0123456789ab").write_text("a person's draft")
    assert store.remove_incomplete() == []
    assert sorted(os.listdir(store.step_dir(3))) == [COMPLETE_NAME, "notes.txt", "notes.txt.tmp-0123456789ab",
                                                     "rank-00000", "rank-00001"]


@pytest.mark.parametrize("damage", [
    "not json", "a list", "another run", "another step", "a float step", "a bool node", "a rank twice",
    "a negative rank", "an extra key", "a string node", "too large", "a directory", "a link"])
def test_a_damaged_or_foreign_complete_is_not_listed(tmp_path, damage):
    store = NodeStore(tmp_path / "mem", RUN)
    _complete_step(store, 6)
    good = {"run": RUN, "step": 6, "node": 0, "ranks": [0, 1]}
    complete = store.step_dir(6) / COMPLETE_NAME
    records = {"not json": b"{\"run\":", "a list": [good], "another run": {**good, "run": OTHER},
               "another step": {**good, "step": 5}, "a float step": {**good, "step": 6.0},
               "a bool node": {**good, "node": True},
               "a rank twice": {**good, "ranks": [0, 0]}, "a negative rank": {**good, "ranks": [-1]},
               "an extra key": {**good, "extra": 1}, "a string node": {**good, "node": "0"}}
    if damage == "too large":
        raw = json.dumps(good).encode()
        complete.write_bytes(raw[:-1] + b" " * (MAX_COMPLETE_BYTES + 1 - len(raw)) + b"}")  # valid JSON, too big
    elif damage == "a directory":
        complete.unlink()
        complete.mkdir()
    elif damage == "a link":
        (tmp_path / "elsewhere.json").write_text(json.dumps(good))
        complete.unlink()
        complete.symlink_to(tmp_path / "elsewhere.json")
    else:
        _write_complete(store, 6, records[damage])
    assert store.complete_steps() == {} and store.describe() == []
    assert store.remove_incomplete() == [6]
    assert not store.step_dir(6).exists() and (tmp_path / "mem" / RUN).is_dir()
    if damage == "a link":
        assert (tmp_path / "elsewhere.json").exists()


def test_a_complete_within_the_bound_is_read(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN)
    _complete_step(store, 6)
    raw = json.dumps({"run": RUN, "step": 6, "node": 0, "ranks": [0, 1]}).encode()
    (store.step_dir(6) / COMPLETE_NAME).write_bytes(raw[:-1] + b" " * (MAX_COMPLETE_BYTES - len(raw)) + b"}")
    assert store.complete_steps() == {6: {0, 1}}


def test_retain_keeps_the_newest_and_the_protected(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN)
    for step in (1, 2, 3, 4, 5):
        _complete_step(store, step, ranks=(0,))
    assert store.retain(2, protect=[1]) == [2, 3]
    assert sorted(store.complete_steps()) == [1, 4, 5]
    assert not store.step_dir(2).exists() and not store.step_dir(3).exists()
    assert store.retain(0) == [1, 4, 5] and store.complete_steps() == {}
    with pytest.raises(InvalidOptionError):
        store.retain(-1)


@pytest.mark.parametrize("removal", ["remove_step", "remove_all"])
def test_complete_goes_before_any_rank(tmp_path, monkeypatch, removal):
    store = NodeStore(tmp_path / "mem", RUN)
    _complete_step(store, 8)
    _complete_step(store, 9)
    complete_there = []  # at each tree removal: whether a COMPLETE is still below it
    real_rmtree = shutil.rmtree

    def watch(path, *args, **kwargs):
        complete_there.append(any(Path(path).rglob(COMPLETE_NAME)))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", watch)
    store.remove_step(8) if removal == "remove_step" else store.remove_all()
    assert complete_there and not any(complete_there)
    assert not store.step_dir(8).exists()


def test_a_removal_cut_short_leaves_a_step_nobody_lists(tmp_path, monkeypatch):
    store = NodeStore(tmp_path / "mem", RUN)
    _complete_step(store, 8)

    def die(path, *args, **kwargs):
        raise KeyboardInterrupt  # the process stops before any rank directory is gone

    real_rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", die)
    with pytest.raises(KeyboardInterrupt):
        store.remove_step(8)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert (store.step_dir(8) / "rank-00000").is_dir() and store.complete_steps() == {}
    assert store.remove_incomplete() == [8] and not store.step_dir(8).exists()


def test_a_failed_complete_leaves_nothing(tmp_path, monkeypatch):
    store = NodeStore(tmp_path / "mem", RUN)
    for rank in (0, 1):
        _save_rank(store, 8, rank)

    def fail(src, dst):
        raise OSError("no room")

    monkeypatch.setattr(store.location.storage, "rename", fail)
    with pytest.raises(OSError, match="no room"):
        store.mark_complete(8, [0, 1])
    assert sorted(os.listdir(store.step_dir(8))) == ["rank-00000", "rank-00001"]


def test_a_crash_before_completes_rename_leaves_the_step_unlisted(tmp_path, monkeypatch):
    store = NodeStore(tmp_path / "mem", RUN)
    for rank in (0, 1):
        _save_rank(store, 8, rank)

    def die(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.location.storage, "rename", die)
    monkeypatch.setattr(store.location.storage, "remove", lambda path: None)  # dead: nothing cleans up
    with pytest.raises(KeyboardInterrupt):
        store.mark_complete(8, [0, 1])
    assert store.complete_steps() == {}
    assert store.remove_incomplete() == [8]


def test_listed_ranks_are_those_complete_names_and_still_committed(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN)
    _complete_step(store, 8, ranks=(0, 1))
    _save_rank(store, 8, 2)  # committed, but not part of the step's decision
    shutil.rmtree(store.step_dir(8) / "rank-00001")  # removed behind the store's back
    assert store.complete_steps() == {8: {0}}
    assert store.describe()[0]["ranks"] == [0]


def test_a_missing_parent_is_not_created(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        NodeStore(tmp_path / "absent" / "mem", RUN)
    assert not (tmp_path / "absent").exists()


def test_other_runs_and_other_entries_are_untouched(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN)
    other = NodeStore(tmp_path / "mem", OTHER)
    _complete_step(other, 2)
    _save_rank(other, 3, 0)  # the other run's incomplete step
    _complete_step(store, 1)
    _complete_step(store, 2)
    _save_rank(store, 3, 0)
    (store.path / "step-12").mkdir()  # not a step name as made: never listed, never removed
    (store.path / "step-000000009").mkdir()
    (store.path / "README").write_text("a person's")
    outside = tmp_path / "outside"
    (outside / "rank-00000").mkdir(parents=True)
    (outside / COMPLETE_NAME).write_text("not ours")
    (store.path / "step-00000020").symlink_to(outside)  # a link named like a step: not followed
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "mem" / OTHER).rglob("*"))

    assert store.remove_incomplete() == [3]
    assert store.retain(1) == [1]
    assert sorted(store.complete_steps()) == [2]
    store.remove_step(20)
    assert sorted(os.listdir(outside)) == [COMPLETE_NAME, "rank-00000"]
    assert sorted(os.listdir(store.path)) == ["README", "step-000000009", "step-00000002", "step-00000020", "step-12"]
    store.remove_all()
    assert not store.path.exists() and (outside / "rank-00000").is_dir()
    assert sorted(os.listdir(tmp_path / "mem")) == [OTHER]
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "mem" / OTHER).rglob("*")) == before
    assert other.complete_steps() == {2: {0, 1}} and other.committed_ranks(3) == {0}


def test_prepare_step_refuses_a_link_named_like_a_step(tmp_path):
    store = NodeStore(tmp_path / "mem", RUN)
    ckpt.save({"w": torch.zeros(2)}, str(tmp_path / "outside" / "rank-00000"), no_dist=True)
    store.step_dir(4).symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafeCheckpointError, match="not a directory of its own"):
        store.prepare_step(4)
    assert store.committed_ranks(4) == set()

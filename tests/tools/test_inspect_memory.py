"""ckpt-inspect ROOT lists the memory tier's steps of ROOT's run on this machine after the storage
steps (issue 38 item 4): node, the node's own ranks and its partner's copies, bytes; from --memory DIR
or the checkpoint.memory the newest step records; --json's "memory"; another run's directory never
listed; a missing directory lists nothing; an unsafe one is one note; nothing created or changed."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.memory.store import COMPLETE_NAME, NodeStore
from ckpt.root import read_claim
from ckpt.storage import locate
from ckpt.units import human_bytes
from tools.inspection import main, rank_ranges


def _out(capsys, argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _memory_lines(out: str) -> dict[str, list[str]]:
    """The memory table's rows by step (the lines after its header)."""
    lines = out.split("memory steps of run", 1)[1].splitlines()[2:]
    return {line.split()[0]: line.split() for line in lines}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A one-rank run with the memory tier, stopped without a clean finish (its memory steps stay);
    its steps record the memory directory as the trainer does (user.config.checkpoint.memory)."""
    base = tmp_path_factory.mktemp("memory-run")
    root, memory = base / "run", base / "shm"
    before = os.environ.pop("LOCAL_WORLD_SIZE", None)
    try:
        manager = ckpt.CheckpointManager(root, interval=2, memory=memory, memory_keep=2, catalog="",
                                         user_metadata={"config": {"checkpoint": {"memory": str(memory)}}})
        for step in range(1, 6):
            manager.save(step, {"w": torch.arange(64, dtype=torch.float32) + step})
            manager.wait()  # finished before the next: none skipped as busy (the memory gate)
        manager.close(finished=False)
    finally:
        if before is not None:
            os.environ["LOCAL_WORLD_SIZE"] = before
    return root, memory


def _run_id(root: Path) -> str:
    return read_claim(locate(str(root)))["run"]


def _snapshot(path: Path) -> dict:
    return {str(p): (stat.S_IMODE(p.lstat().st_mode), p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in [path, *path.rglob("*")]}


def test_the_steps_of_a_run_with_the_memory_tier_from_its_recorded_directory(trained, capsys):
    root, memory = trained
    run = _run_id(root)
    before = _snapshot(memory)
    code, out, err = _out(capsys, [root])
    assert code == 0 and err == ""
    step_dir = memory / run / "step-00000005"
    assert f"memory steps of run {run} in {memory} on this machine:" in out
    assert out.index("committed") < out.index("memory steps")  # after the storage steps
    rows = _memory_lines(out)
    assert rows.keys() == {"4", "5"}  # memory_keep 2; step 5 is in memory only
    assert rows["5"] == ["5", "0", "0", "none", *human_bytes(_tree_bytes(step_dir / "rank-00000")).split()]

    code, out, _ = _out(capsys, [root, "--json"])
    doc = json.loads(out)
    assert code == 0 and doc["memory_directory"] == str(memory)
    assert [row["step"] for row in doc["steps"]] == [2, 4]
    assert doc["memory"][1] == {"step": 5, "node": 0, "ranks": [0], "own": [0], "partner": [], "partner_node": None,
                                "bytes": _tree_bytes(step_dir / "rank-00000")}
    assert [row["step"] for row in doc["memory"]] == [4, 5]
    assert _snapshot(memory) == before  # read only


def _two_node_layout(memory: Path, run: str) -> Path:
    """Node 1 of two (2 ranks each): its ranks 2 and 3, copies of node 0's ranks 0 and 1 (step 7);
    step 6's COMPLETE from before records were told the ranks per node."""
    store = NodeStore(memory, run, node=1)
    for step in (6, 7):
        store.prepare_step(step)
        for rank in (0, 1, 2, 3):
            ckpt.save({"w": torch.full((8 + rank,), float(rank))}, store.rank_location(step, rank), no_dist=True)
    store.mark_complete(6, [0, 1, 2, 3])
    store.mark_complete(7, [0, 1, 2, 3], local_world=2)
    return store.path


def test_own_ranks_and_the_partner_nodes_copies(trained, tmp_path, capsys):
    root, _ = trained
    memory = tmp_path / "shm"
    where = _two_node_layout(memory, _run_id(root))
    code, out, err = _out(capsys, [root, "--memory", memory])
    assert code == 0 and err == ""
    rows = _memory_lines(out)
    assert rows["7"][:5] == ["7", "1", "2-3", "0-1", "(node"] and rows["7"][5] == "0)"
    assert rows["6"][:4] == ["6", "1", "-", "-"]  # a record without the ranks per node: not told apart
    code, out, _ = _out(capsys, [root, "--memory", memory, "--json"])
    doc = json.loads(out)
    assert code == 0 and doc["memory_directory"] == str(memory)
    assert doc["memory"] == [
        {"step": 6, "node": 1, "ranks": [0, 1, 2, 3], "own": None, "partner": None, "partner_node": None,
         "bytes": _tree_bytes(where / "step-00000006") - (where / "step-00000006" / COMPLETE_NAME).stat().st_size},
        {"step": 7, "node": 1, "ranks": [0, 1, 2, 3], "own": [2, 3], "partner": [0, 1], "partner_node": 0,
         "bytes": _tree_bytes(where / "step-00000007") - (where / "step-00000007" / COMPLETE_NAME).stat().st_size}]


def test_another_runs_memory_steps_are_not_listed(trained, tmp_path, capsys):
    root, _ = trained
    memory = tmp_path / "shm"
    _two_node_layout(memory, "another-run")
    code, out, _ = _out(capsys, [root, "--memory", memory])
    assert code == 0 and f"no memory steps of run {_run_id(root)} in {memory} on this machine" in out
    code, out, _ = _out(capsys, [root, "--memory", memory, "--json"])
    assert code == 0 and json.loads(out)["memory"] == []


def test_a_missing_directory_lists_nothing_and_is_not_made(trained, tmp_path, capsys):
    root, _ = trained
    code, out, err = _out(capsys, [root, "--memory", tmp_path / "absent", "--json"])
    assert code == 0 and err == "" and json.loads(out)["memory"] == []
    assert not (tmp_path / "absent").exists()


def test_a_recorded_directory_that_is_not_here_is_not_mentioned(tmp_path, capsys):
    root = tmp_path / "run"
    config = {"config": {"checkpoint": {"memory": str(tmp_path / "on-another-machine")}}}
    with ckpt.CheckpointManager(root, catalog="", user_metadata=config) as manager:
        manager.save(1, {"w": torch.zeros(4)})
    code, out, err = _out(capsys, [root])
    assert code == 0 and err == "" and "memory" not in out
    code, out, _ = _out(capsys, [root, "--json"])
    doc = json.loads(out)
    assert doc["memory_directory"] is None and doc["memory"] == []


def test_an_unsafe_directory_is_one_note(trained, tmp_path, capsys):
    root, _ = trained
    memory = tmp_path / "shm"
    where = _two_node_layout(memory, _run_id(root))
    os.chmod(where, 0o755)  # open to other users: the store refuses it
    code, out, err = _out(capsys, [root, "--memory", memory])
    assert code == 0 and "committed" in out and f"no memory steps of run {_run_id(root)}" in out
    assert err.startswith(f"ckpt-inspect: note: memory steps in {memory} not listed:") and err.count("\n") == 1
    assert "open to other users" in err


def test_memory_steps_of_a_root_without_storage_steps(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    root, memory = tmp_path / "run", tmp_path / "shm"
    manager = ckpt.CheckpointManager(root, interval=100, memory=memory, catalog="")
    manager.save(1, {"w": torch.zeros(4)})
    manager.close(finished=False)
    code, out, _ = _out(capsys, [root, "--memory", memory, "--json"])
    assert code == 0 and json.loads(out)["steps"] == [] and [r["step"] for r in json.loads(out)["memory"]] == [1]
    assert _out(capsys, [root])[0] == 1  # nothing to list without the directory: not a checkpoint root


def test_a_root_without_a_run_record_is_one_note(trained, tmp_path, capsys):
    root, memory = trained
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    (copy / ".run").unlink()
    code, out, err = _out(capsys, [copy, "--memory", memory, "--json"])
    assert code == 0 and json.loads(out)["memory"] == []
    assert err == (f"ckpt-inspect: note: {copy} has no run record (.run): its memory steps in {memory} cannot be "
                   "told apart; not listed\n")


def test_ranks_are_shown_as_ranges():
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and rank_ranges([3]) == "3"
    assert rank_ranges([]) == "none" and rank_ranges(None) is None


@pytest.mark.parametrize("local_world", [0, "2", 1.0, True])
def test_a_record_with_a_bad_count_of_ranks_per_node_is_not_listed(tmp_path, local_world):
    where = _two_node_layout(tmp_path / "shm", "run-a")
    complete = where / "step-00000007" / COMPLETE_NAME
    record = json.loads(complete.read_text())
    complete.write_text(json.dumps(dict(record, local_world=local_world)))
    assert [step["step"] for step in NodeStore(tmp_path / "shm", "run-a", create=False).describe()] == [6]


def test_memory_goes_with_the_listing_only(trained, capsys):
    root, memory = trained
    with pytest.raises(SystemExit) as stopped:
        main([str(root), "--verify", "--memory", str(memory)])
    assert stopped.value.code == 2

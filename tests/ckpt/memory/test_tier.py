"""The memory tier through the manager, on 4 gloo ranks playing 2 nodes of 2 (LOCAL_WORLD_SIZE=2,
each node its own memory directory): a restart resumes from the newest memory step, newer than
storage's; a lost node's ranks fetch their files from the partner node; a rank whose own copy fails
its check (a flipped byte in its data or its manifest) takes the partner node's copy; both copies
of one rank's files lost, or both damaged, send the run back to storage; a memory save that does not
fit is skipped with storage saves unaffected; a clean finish removes the run's memory steps. Each
rank's state differs (rank-local, as sharded states are) and is checked bitwise."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.launch import run_ranks

WORLD, LOCAL = 4, 2


def _state(rank: int, step: int) -> dict:
    """Rank-local keys, as a sharded state's are to DCP (a plain tensor under one key on every rank
    would be saved once, as replicated)."""
    return {f"w{rank}": torch.arange(4096, dtype=torch.float32) * (step + 1) + rank, "step": step,
            f"note{rank}": f"rank {rank} at {step}"}


def _manager(rank: int, root: str, memory: str, **options):
    import ckpt

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    return ckpt.CheckpointManager(root, interval=2, keep=3, memory=f"{memory}/node{rank // LOCAL}", **options)


def _train(rank: int, world: int, root: str, memory: str, steps: int, room: int | None = None,
           memory_interval: int = 1) -> dict:
    if room is not None:  # a RAM file system this small (Docker's default /dev/shm is 64 MB)
        from ckpt.memory.store import NodeStore

        NodeStore.free_bytes = lambda self: room
    manager = _manager(rank, root, memory, memory_interval=memory_interval)
    live = _state(rank, 0)
    for step in range(1, steps + 1):
        live.update(_state(rank, step))
        manager.save(step, live)
        manager.wait()  # each memory save finished before the next step: none skipped as busy
    stats = manager.stats
    manager.close(finished=False)  # as a crash would leave it: memory steps stay
    return {"saves": stats.saves, "memory_saves": stats.memory_saves, "memory_skipped": stats.memory_skipped}


def _resume(rank: int, world: int, root: str, memory: str, strict: bool = True, noted: bool = False) -> tuple:
    """(the step loaded, whether the state is that step's bitwise), and with ``noted`` the tier's one line."""
    manager = _manager(rank, root, memory)
    live = _state(rank, 0)
    step = manager.load(live, strict=strict)
    expected = _state(rank, step)
    equal = (torch.equal(live[f"w{rank}"], expected[f"w{rank}"]) and live["step"] == step
             and live[f"note{rank}"] == expected[f"note{rank}"])
    note = manager.memory_note
    manager.close()  # a clean finish: the run's memory steps go
    return (step, equal, note) if noted else (step, equal)


def _run_dirs(memory: Path) -> list[Path]:
    return sorted(p for node in memory.iterdir() for p in node.iterdir() if p.is_dir())


@pytest.fixture
def trained(tmp_path):
    root, memory = tmp_path / "ckpt", tmp_path / "shm"
    memory.mkdir()  # the RAM file system's mount point (/dev/shm); each node's folder made by its ranks
    stats = run_ranks(WORLD, _train, str(root), str(memory), 5)
    return root, memory, stats


def test_a_restart_resumes_from_the_newest_memory_step(trained):
    root, memory, stats = trained
    assert [s["memory_saves"] for s in stats] == [5] * WORLD and [s["saves"] for s in stats] == [2] * WORLD
    for node in ("node0", "node1"):  # own ranks and the partner node's copies, the newest 2 steps
        (run,) = [p for p in (memory / node).iterdir()]
        assert sorted(p.name for p in run.iterdir()) == ["step-00000004", "step-00000005"]
        assert sorted(p.name for p in (run / "step-00000005").iterdir() if p.is_dir()) == [
            f"rank-{r:05d}" for r in range(WORLD)]
        assert oct(run.stat().st_mode & 0o777) == "0o700"
    results = run_ranks(WORLD, _resume, str(root), str(memory))
    assert results == [(5, True)] * WORLD  # storage's newest is 4
    assert [list((memory / node).iterdir()) for node in ("node0", "node1")] == [[], []]  # clean finish: removed


@pytest.mark.slow
def test_a_lost_node_takes_its_files_from_the_partner(trained):
    root, memory, _ = trained
    shutil.rmtree(memory / "node1")  # the node was replaced: an empty RAM file system
    (memory / "node1").mkdir()
    assert run_ranks(WORLD, _resume, str(root), str(memory)) == [(5, True)] * WORLD


@pytest.mark.slow
def test_both_copies_of_a_rank_lost_falls_back_to_storage(trained):
    root, memory, _ = trained
    for run in _run_dirs(memory):
        for step in run.iterdir():
            shutil.rmtree(step / "rank-00001", ignore_errors=True)
    assert run_ranks(WORLD, _resume, str(root), str(memory)) == [(4, True)] * WORLD


def _own_and_partner_copy(memory: Path, rank: int, step: int = 5) -> tuple[Path, Path]:
    """Where ``rank``'s files of ``step`` lie on its own node and on its partner node."""
    (own,) = (memory / f"node{rank // LOCAL}").iterdir()
    (partner,) = (memory / f"node{1 - rank // LOCAL}").iterdir()
    return tuple(run / f"step-{step:08d}" / f"rank-{rank:05d}" for run in (own, partner))


@pytest.mark.slow
def test_a_flipped_byte_in_a_memory_copy_is_caught_and_the_partner_s_copy_used(trained):
    """Rank 0's own copy of step 5 fails its checksum while loading: it takes node 1's copy of its
    files, every rank is at step 5 bitwise (was: the whole run back to storage's step 4)."""
    from tests.support.checkpoints import flip_byte

    root, memory, _ = trained
    own, _ = _own_and_partner_copy(memory, 0)
    flip_byte(own, largest=True)
    results = run_ranks(WORLD, _resume, str(root), str(memory), True, True)
    assert [(step, equal) for step, equal, _ in results] == [(5, True)] * WORLD
    assert results[0][2] == ("resumed from memory step 5 (storage's newest: 4; rank 0 from the partner's copy, "
                             "its own failing its check)")


@pytest.mark.slow
def test_a_damaged_manifest_in_memory_is_caught_before_any_rank_loads_and_the_partner_s_copy_used(trained):
    """Rank 1's own manifest of step 5 is damaged: caught before any rank loads; then rank 1 takes
    node 1's copy and every rank loads step 5."""
    root, memory, _ = trained
    own, _ = _own_and_partner_copy(memory, 1)
    manifest = bytearray((own / "manifest.json").read_bytes())
    manifest[len(manifest) // 2] ^= 0x01
    (own / "manifest.json").write_bytes(bytes(manifest))
    assert run_ranks(WORLD, _resume, str(root), str(memory)) == [(5, True)] * WORLD


@pytest.mark.slow
def test_both_copies_of_a_rank_damaged_fall_back_to_storage_saying_so(trained):
    from tests.support.checkpoints import flip_byte

    root, memory, _ = trained
    for copy in _own_and_partner_copy(memory, 0):
        flip_byte(copy, largest=True)
    results = run_ranks(WORLD, _resume, str(root), str(memory), True, True)
    assert [(step, equal) for step, equal, _ in results] == [(4, True)] * WORLD
    note = results[0][2]
    assert note.startswith("memory step 5 unusable (rank 0: ") and "; its partner's copy: " in note, note
    assert note.endswith(": resuming from storage"), note


@pytest.mark.slow
def test_a_memory_save_without_room_is_skipped_and_storage_saves_go_on(tmp_path):
    root, memory = tmp_path / "ckpt", tmp_path / "shm"
    memory.mkdir()
    stats = run_ranks(WORLD, _train, str(root), str(memory), 4, 1 << 20)
    assert [(s["memory_saves"], s["memory_skipped"], s["saves"]) for s in stats] == [(0, 4, 2)] * WORLD
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000002", "step-00000004"]


def _open_with_one_node_s_folder_missing(rank: int, world: int, root: str, memory: str) -> tuple:
    """Node 1's RAM file system is not mounted (its folder's parent is missing): every rank's
    constructor raises that node's error, none hangs, and each releases what it took (the root)."""
    import ckpt

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    folder = f"{memory}/node0" if rank < LOCAL else f"{memory}/unmounted/node1"
    try:
        ckpt.CheckpointManager(root, memory=folder)
    except ckpt.InvalidOptionError as exc:
        error = str(exc)
    else:
        error = None
    with ckpt.CheckpointManager(root, memory=f"{memory}/node{rank // LOCAL}") as manager:  # the root is free
        manager.save(1, _state(rank, 1), force=True)
        manager.wait()
        steps = manager.steps()
    return error, steps


def test_a_node_that_cannot_open_its_memory_folder_stops_every_rank_with_its_error(tmp_path):
    memory = tmp_path / "shm"
    memory.mkdir()
    results = run_ranks(WORLD, _open_with_one_node_s_folder_missing, str(tmp_path / "ckpt"), str(memory))
    for error, steps in results:
        assert error is not None and "unmounted" in error and "does not exist" in error
        assert steps == [1]


@pytest.mark.slow
def test_another_layout_resumes_from_storage(trained):
    """2 ranks on one node where 4 saved: node 0's folder holds every rank's files of step 5 (its own
    and the partner's copies), but they were saved by a 4-rank layout: storage's step 4 is loaded."""
    root, memory, _ = trained
    assert run_ranks(2, _resume, str(root), str(memory), False) == [(4, True)] * 2  # ranks 2, 3's keys left


@pytest.mark.slow
def test_a_newer_storage_step_wins(tmp_path):
    root, memory = tmp_path / "ckpt", tmp_path / "shm"
    memory.mkdir()
    run_ranks(WORLD, _train, str(root), str(memory), 4, None, 3)  # memory at 3, storage at 2 and 4
    assert run_ranks(WORLD, _resume, str(root), str(memory)) == [(4, True)] * WORLD


def test_one_process_saves_to_memory_unless_told_not_and_recovers_memory_alone(tmp_path):
    """One process (no partner): every step to memory, storage every 2; ``save(memory=False)`` leaves a
    step out of memory; ``recover_memory`` loads the newest memory step and nothing from storage."""
    import ckpt

    memory = tmp_path / "shm"
    memory.mkdir()
    manager = ckpt.CheckpointManager(tmp_path / "ckpt", interval=2, memory=str(memory / "node0"))
    for step in (1, 2, 3):
        manager.save(step, _state(0, step))
        manager.wait()  # finished before the next: none skipped as busy
    manager.save(4, _state(0, 4), force=True, memory=False)  # a final export: storage only
    manager.wait()
    assert (manager.stats.saves, manager.stats.memory_saves) == (2, 3)
    manager.close(finished=False)
    again = ckpt.CheckpointManager(tmp_path / "ckpt", interval=2, memory=str(memory / "node0"))
    live = _state(0, 0)
    assert again.recover_memory(live) is None  # memory's newest (3) is older than storage's (4)
    assert again.load(live) == 4 and torch.equal(live["w0"], _state(0, 4)["w0"])
    again.close()


def _reopened_after_steps_1_to_3(tmp_path):
    """One process, one node: steps 1-3 in memory, storage every 2 (step 2), closed as a crash leaves
    it; a new manager on the same root and memory folder."""
    import ckpt

    memory = tmp_path / "shm"
    memory.mkdir()
    manager = ckpt.CheckpointManager(tmp_path / "ckpt", interval=2, memory=str(memory / "node0"))
    for step in (1, 2, 3):
        manager.save(step, _state(0, step))
        manager.wait()
    manager.close(finished=False)
    return ckpt.CheckpointManager(tmp_path / "ckpt", interval=2, memory=str(memory / "node0"))


def test_a_load_of_a_memory_only_step_by_number_says_it_is_one(tmp_path):
    """``load(step=N)`` reads storage (a memory step is never history): for a step only the memory
    tier holds, the not-found error says so; for a step nowhere, it stays the plain one."""
    import ckpt

    again = _reopened_after_steps_1_to_3(tmp_path)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"committed steps: 2; step 3 is a memory-tier step"):
        again.load(_state(0, 0), step=3)
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"committed steps: 2$"):
        again.load(_state(0, 0), step=7)
    assert again.load(_state(0, 0)) == 3  # the newest, from memory
    again.close()


def test_a_memory_save_pauses_the_garbage_collector(tmp_path, monkeypatch):
    """The objects a save builds (records, manifests) die with it: collected while alive, they would
    be promoted and bring on full collections of the whole process (the cost the pause removes)."""
    import gc

    from ckpt.memory import MemoryTier, tier

    seen, write = [], tier.write_local
    monkeypatch.setattr(tier, "write_local", lambda *args, **kw: (seen.append(gc.isenabled()), write(*args, **kw))[1])
    memory = MemoryTier(tmp_path / "shm", "run1")
    assert gc.isenabled() and memory.save(1, _state(0, 1))
    assert seen == [False] and gc.isenabled()  # paused while writing, on again after


def _sharded(step: int):
    """A tensor sharded over the 4 ranks (a DTensor, as FSDP's parameters are): each rank holds a
    quarter, so no rank's own checkpoint covers its global shape."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(4 * 1024, dtype=torch.float32).reshape(64, 64) * (step + 1)
    return distribute_tensor(full, init_device_mesh("cpu", (WORLD,)), [Shard(0)])


def _sharded_run(rank: int, world: int, root: str, memory: str) -> tuple:
    manager = _manager(rank, root, memory)
    live = {"w": _sharded(0), "step": 0}
    for step in range(1, 4):
        live = {"w": _sharded(step), "step": step}
        manager.save(step, live)
        manager.wait()
    saved = manager.stats.memory_saves
    manager.close(finished=False)
    manager = _manager(rank, root, memory)
    live = {"w": _sharded(0), "step": 0}
    step = manager.load(live)
    equal = torch.equal(live["w"].to_local(), _sharded(3).to_local()) and live["step"] == 3
    manager.close()
    return saved, step, equal


def test_a_sharded_state_is_kept_and_resumed_as_each_rank_s_local_shard(tmp_path):
    """FSDP's DTensors: each rank keeps its local shard (was: every memory save failed, "chunks do
    not cover its shape", so a trainer run never had a memory step)."""
    (tmp_path / "shm").mkdir()
    results = run_ranks(WORLD, _sharded_run, str(tmp_path / "ckpt"), str(tmp_path / "shm"))
    assert results == [(3, 3, True)] * WORLD  # storage holds step 2 only


def test_where_a_load_came_from_and_why_storage_when_a_rank_s_files_are_gone(tmp_path):
    """``loaded_from`` names the tier the last load's step came from, ``memory_note`` the tier's one
    line about it; a step whose every copy of a rank's files is gone is named as the reason storage
    was used (was: storage used without a word)."""
    import ckpt

    again = _reopened_after_steps_1_to_3(tmp_path)
    assert again.loaded_from is None
    assert again.load(_state(0, 0)) == 3
    assert again.loaded_from == "memory" and again.memory_note == "resumed from memory step 3 (storage's newest: 2)"
    again.close(finished=False)
    memory = tmp_path / "shm"
    (run,) = (memory / "node0").iterdir()
    for step in ("step-00000002", "step-00000003"):  # memory_keep 2: both steps lose rank 0's files
        shutil.rmtree(run / step / "rank-00000")
    again = ckpt.CheckpointManager(tmp_path / "ckpt", interval=2, memory=str(memory / "node0"))
    assert again.load(_state(0, 0)) == 2 and again.loaded_from == "storage"
    assert again.memory_note == "memory step 3 unusable (rank 0: its files are on no node): resuming from storage"
    again.close()


def _other_history(rank: int, step: int, history: int) -> dict:
    """Rank ``rank``'s state at ``step`` of another history (a branch: other values, same keys)."""
    state = _state(rank, step)
    state[f"w{rank}"] = state[f"w{rank}"] * -history
    return state


def _start(rank: int, root: str, memory: str, interval: int = 2):
    """A start of the 4-rank job: its manager and the step its load gave (where it came from)."""
    import ckpt

    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    manager = ckpt.CheckpointManager(root, interval=interval, keep=3, memory=f"{memory}/node{rank // LOCAL}")
    live = _state(rank, 0)
    return manager, live, (manager.load(live), manager.loaded_from)


def _branches(rank: int, world: int, root: str, memory: str) -> list:
    """After 5 steps (storage 2 and 4, memory 4 and 5): what the load of each start below gave."""
    seen = []
    manager, live, _ = _start(rank, root, memory)
    live.update(_state(rank, 2))
    manager.load(live, step=2)  # a start that loads step 2 and stops there (a branch refused): nothing lost
    manager.close(finished=False)
    manager, live, loaded = _start(rank, root, memory)
    seen.append(loaded)
    manager.load(live, step=2)  # a branch from step 2; a crash before its first save
    manager.discard_after(2)
    manager.close(finished=False)
    manager, live, loaded = _start(rank, root, memory, interval=100)
    seen.append(loaded)
    for step in (3, 4, 5):  # the branch trains on (memory 4 and 5 again, no storage save), then crashes
        live.update(_other_history(rank, step, 1))
        manager.save(step, live)
        manager.wait()
    manager.close(finished=False)
    manager, live, _ = _start(rank, root, memory, interval=100)
    manager.load(live, step=2)  # an older step again, no storage step after it (step 4 deleted): no branch needed
    live.update(_other_history(rank, 3, 2))
    manager.save(3, live)  # the third history's first save, then a crash
    manager.wait()
    manager.close(finished=False)
    manager, live, loaded = _start(rank, root, memory)
    seen.append(loaded + (torch.equal(live[f"w{rank}"], _other_history(rank, 3, 2)[f"w{rank}"]),))
    manager.close()
    return seen


@pytest.mark.slow
def test_a_branch_leaves_no_memory_step_of_the_old_history(trained):
    """A branch (``discard_after``) removes the memory steps after its step too, and the first memory
    save after a load those after the loaded step: a crash never resumes from the history the run
    left (was: memory step 5 of the first history, newer than the branch's storage step, resumed).
    A start that only loaded an older step and stopped (a refused branch) loses no memory step."""
    root, memory, _ = trained
    results = run_ranks(WORLD, _branches, str(root), str(memory))
    assert results == [[(5, "memory"), (2, "storage"), (3, "memory", True)]] * WORLD

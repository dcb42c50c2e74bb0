"""ckpt.write.pipeline: one save pipeline for the manager and every path-based plug-in. A fault
injected in it reaches a manager save, a Lightning save and a plain PathStore save alike; what the
plug-ins gained by sharing it (the busy policy, ``on_error``) and what the pipeline keeps for them
(a second path of the same snapshot, a delta never built on a failed write) is pinned here."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ckpt
from ckpt import CheckpointManager
from ckpt.integrations._store import PathStore
from ckpt.write import SavePipeline, Target
from ckpt.root import committed_steps


class _Gate:
    """Holds the pipeline's writes until released, or makes each of them fail."""

    def __init__(self, monkeypatch, *, fail: bool = False):
        self.open = threading.Event()
        self.persisted: list = []
        original = SavePipeline._persist

        def persist(pipeline, target, snapshot, plain):
            self.persisted.append(target.key)
            if fail:
                raise OSError(5, "Input/output error")
            assert self.open.wait(timeout=60), "gate never opened"
            return original(pipeline, target, snapshot, plain)

        monkeypatch.setattr(SavePipeline, "_persist", persist)


def _failing_paths(monkeypatch, *names):
    original = PathStore._write

    def write(store, flat, path, step, base, run):
        if os.path.basename(path) in names:
            raise OSError(5, "Input/output error")
        return original(store, flat, path, step, base, run)

    monkeypatch.setattr(PathStore, "_write", write)


def _load(path):
    store = PathStore()
    try:
        return store.load(path)
    finally:
        store.close()


def test_a_fault_in_the_pipeline_reaches_a_manager_a_path_store_and_lightning(tmp_path, monkeypatch):
    fault = _Gate(monkeypatch, fail=True)
    with pytest.raises(ckpt.CheckpointWriteError, match="Input/output error"):
        with CheckpointManager(tmp_path / "manager", interval=1) as manager:
            manager.save(1, {"w": torch.ones(4)})
    assert committed_steps(tmp_path / "manager") == []

    store = PathStore()
    store.save({"w": torch.ones(4)}, tmp_path / "model.ckpt", step=2)
    with pytest.raises(ckpt.CheckpointWriteError, match="Input/output error"):
        store.close()
    assert not (tmp_path / "model.ckpt").exists()

    lightning = pytest.importorskip("ckpt.integrations.lightning")
    io = lightning.CkptCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 3}, tmp_path / "epoch=0-step=3.ckpt")
    with pytest.raises(ckpt.CheckpointWriteError, match="Input/output error"):
        io.teardown()
    assert not (tmp_path / "epoch=0-step=3.ckpt").exists()
    assert fault.persisted == [1, str(tmp_path / "model.ckpt"), str(tmp_path / "epoch=0-step=3.ckpt")]


def test_a_path_store_skips_when_both_buffers_are_busy_under_policy_skip(tmp_path, monkeypatch):
    """Came with the pipeline: the store used to raise SnapshotSkipped out of the framework's save."""
    gate = _Gate(monkeypatch)
    store = PathStore(policy="skip")
    state = {"w": torch.randn(64, 64)}
    store.save(state, tmp_path / "a", step=1)
    store.save(state, tmp_path / "b", step=2)
    with pytest.warns(UserWarning, match="skipped"):
        store.save(state, tmp_path / "c", step=3)
    assert store.stats.skipped == 1 and store.stats.saves == 2
    gate.open.set()
    store.close()
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


@pytest.mark.parametrize("mode", ["double_buffer", "sync"])
def test_a_path_store_warns_counts_and_goes_on_under_on_error_continue(tmp_path, monkeypatch, mode):
    """Came with the pipeline: the store used to raise every failure whatever ``on_error`` said."""
    _failing_paths(monkeypatch, "a")
    store = PathStore(on_error="continue", async_mode=mode)
    with pytest.warns(UserWarning, match="Input/output error"):
        store.save({"w": torch.ones(4)}, tmp_path / "a", step=1)
        store.save({"w": torch.ones(4) * 2}, tmp_path / "b", step=2)
        store.wait()
    store.close()
    assert store.stats.failures == 1 and sorted(os.listdir(tmp_path)) == ["b"]
    assert torch.equal(_load(tmp_path / "b")["w"], torch.ones(4) * 2)


def test_a_second_path_at_the_same_step_is_written_from_the_same_snapshot(tmp_path, monkeypatch):
    """Lightning saves ``last.ckpt`` right after the top-k file, with no training in between: the
    second save is the first one's snapshot (its plain values its own), even if the live tensor changed
    since, while a write still reads that snapshot; once none does, its buffers may be reused: staged afresh."""
    store = PathStore()
    w = torch.ones(8)
    gate = _Gate(monkeypatch)
    store.save({"w": w, "epoch": 1}, tmp_path / "top.ckpt", step=6)
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).step()  # waits for the snapshot: w may change
    w.add_(1)
    store.save({"w": w, "epoch": 2}, tmp_path / "last.ckpt", step=6)
    gate.open.set()
    store.wait()
    store.save({"w": w, "epoch": 3}, tmp_path / "later.ckpt", step=6)  # both writes ended: staged afresh
    store.close()
    last, later = _load(tmp_path / "last.ckpt"), _load(tmp_path / "later.ckpt")
    assert torch.equal(last["w"], torch.ones(8)) and last["epoch"] == 2
    assert torch.equal(later["w"], torch.full((8,), 2.0)) and later["epoch"] == 3


def test_a_delta_queued_on_a_path_whose_write_fails_is_stored_whole(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    _failing_paths(monkeypatch, "a")
    store = PathStore(full_every=4, on_error="continue")
    store.save({"w": torch.ones(64)}, tmp_path / "a", step=1)
    store.save({"w": torch.ones(64) * 2}, tmp_path / "b", step=2)  # queued as a delta on a
    assert store.stats.deltas == 1
    gate.open.set()
    with pytest.warns(UserWarning, match="Input/output error"):
        store.close()
    assert ckpt.read_manifest(tmp_path / "b").kind == "full"
    assert torch.equal(_load(tmp_path / "b")["w"], torch.ones(64) * 2)


def test_a_delta_builds_only_on_a_named_sibling_at_another_step():
    """The manager's steps and a plug-in's paths under one rule (ckpt.write.may_build_on)."""
    written: dict = {}

    def target(key, step, folder="run", name=True):
        return Target(key, step, lambda tree, base: written.__setitem__(key, base and base.name),
                      folder=folder, name=key if name else None)

    state = {"w": torch.ones(4)}
    pipeline = SavePipeline(ckpt.SaveOptions(full_every=8))
    # itself again; the same step (its snapshot again); another folder; after one without a name;
    # without a step; after one without a step
    never = [target("a", 1), target("a", 2), target("b", 2), target("c", 3, folder="other"),
             target("d", 4, name=False), target("e", 5), target("f", None), target("g", 6)]
    assert [pipeline.save(t, state).base for t in never] == [None] * len(never)
    assert [pipeline.save(t, state).base for t in (target("h", 7), target("i", 8))] == ["g", "h"]
    pipeline.close()
    assert written == {**dict.fromkeys("abcdefgh"), "h": "g", "i": "h"}


def test_a_synchronous_save_leaves_nothing_in_flight():
    written: list = []
    pipeline = SavePipeline(ckpt.SaveOptions(async_mode="sync"))
    for step in (1, 2):
        target = Target(step, step, lambda tree, base, step=step: written.append((step, base)))
        assert pipeline.save(target, {"w": torch.ones(2)}) is not None
    pipeline.close()
    assert written == [(1, None), (2, None)] and pipeline.deltas.bases_in_flight() == {}


@pytest.mark.parametrize("full_every", [1, 3])
def test_close_leaves_no_snapshot_held(tmp_path, monkeypatch, full_every):
    """After ``close`` nothing of the pipeline holds a staged snapshot, so the stager's buffers can go
    back to the allocator (pinned memory on a device): the delta chain's last snapshot included."""
    import gc
    import weakref

    from ckpt.tree import leaves
    from ckpt.write import DoubleBufferStager

    staged = []
    original = DoubleBufferStager.stage

    def stage(stager, *args, **kwargs):
        future = original(stager, *args, **kwargs)
        staged.append(future)
        return future

    monkeypatch.setattr(DoubleBufferStager, "stage", stage)
    model = torch.nn.Linear(8, 8)
    manager = CheckpointManager(str(tmp_path), interval=1, full_every=full_every)
    for step in (1, 2, 3):
        manager.save(step, {"model": model})
    manager.wait()
    held = [weakref.ref(t) for future in staged for t in leaves(future.result()) if isinstance(t, torch.Tensor)]
    assert held
    staged.clear()
    manager.close()
    gc.collect()
    assert [r for r in held if r() is not None] == []

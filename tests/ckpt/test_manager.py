"""CheckpointManager: exact snapshots under mutation, interval and force, backpressure (skip/block),
background errors, locking, start-up clean-up, fallback, and the same on 2 FSDP2 ranks."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from torch import nn

import ckpt
from ckpt.manager import CheckpointManager
from ckpt.root import committed_steps, step_path
from tests import models
from tests.dist import run_ranks


def _big_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # ~4.5M parameters: the background copy takes long enough to race
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 1024), nn.Linear(1024, 512))


def _train(model, optim, step: int) -> None:
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _snapshot(model, optim, step, extra) -> dict:
    full = models.full_state(model, optim)
    return {**full, "step": step, "extra": json.loads(json.dumps(extra))}


@pytest.mark.parametrize("async_mode", ["double_buffer", "sync"])
def test_checkpoint_holds_state_at_save_time(tmp_path, async_mode):
    model = _big_model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = {"loader": {"position": 0}, "tokens": 0}
    expected = {}
    with CheckpointManager(tmp_path, interval=2, keep=10, async_mode=async_mode) as manager:
        manager.attach(optim)
        for step in range(1, 9):
            _train(model, optim, step)
            extra["loader"]["position"] += 16
            extra["tokens"] += 16 * 512
            state = {"model": model, "optim": optim, "step": step, "extra": extra}
            before = _snapshot(model, optim, step, extra)  # the state at save() time
            if manager.save(step, state):
                expected[step] = before
                # Mutate everything at once: values were captured synchronously; tensors may change
                # only after the optimizer pre-hook waited for the background snapshot copy.
                extra["loader"]["position"] = -1
                optim.step()  # no grads: a no-op for parameters, but the hook runs first
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.5)
                extra["loader"]["position"] = before["extra"]["loader"]["position"]
        manager.wait()
        assert manager.steps() == [2, 4, 6, 8]
    for step, want in expected.items():
        fresh = _big_model(seed=step + 100)
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        state = {"model": fresh, "optim": fresh_optim, "step": 0, "extra": None}
        ckpt.load(state, step_path(tmp_path, step))
        got = {**models.full_state(fresh, fresh_optim), "step": state["step"], "extra": state["extra"]}
        models.assert_same(got, want, f"step {step}")


def test_interval_and_force(tmp_path):
    with CheckpointManager(tmp_path, interval=5) as manager:
        assert [manager.save(s, {"s": s}) for s in range(1, 7)] == [False] * 4 + [True, False]
        assert manager.save(7, {"s": 7}, force=True)
    assert committed_steps(tmp_path) == [5, 7]


class _Gate:
    """Holds background writes until released, to make both buffer sets busy deterministically."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        original = CheckpointManager._persist

        def gated(manager, *args):
            assert self.open.wait(timeout=60), "gate never opened"
            return original(manager, *args)

        monkeypatch.setattr(CheckpointManager, "_persist", gated)


def test_skip_policy_when_both_buffers_busy(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    state = {"w": torch.randn(256, 256)}
    with CheckpointManager(tmp_path, policy="skip") as manager:
        assert manager.save(1, state) and manager.save(2, state)
        with pytest.warns(UserWarning, match="skipped"):
            assert not manager.save(3, state)
        assert manager.stats.skipped == 1
        assert manager.stats.host_buffer_bytes == 2 * 256 * 256 * 4  # bounded: two sets, never more
        gate.open.set()
        manager.wait()
        assert manager.save(4, state)
    assert committed_steps(tmp_path) == [1, 2, 4]


def test_block_policy_waits_for_a_free_buffer(tmp_path, monkeypatch):
    gate = _Gate(monkeypatch)
    state = {"w": torch.randn(64, 64)}
    with CheckpointManager(tmp_path, keep=5) as manager:
        manager.save(1, state)
        manager.save(2, state)
        threading.Timer(0.2, gate.open.set).start()
        assert manager.save(3, state)  # blocks until the gate opens and step 1 is written
    assert committed_steps(tmp_path) == [1, 2, 3]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_background_error_surfaces_and_leaves_nothing(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"ok": torch.ones(2)})
    manager.save(2, {"bad": torch.ones(2, dtype=torch.complex32)})  # no storable dtype code
    with pytest.raises(ckpt.UnsupportedFormatError):
        manager.wait()
    assert committed_steps(tmp_path) == [1]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    manager.save(3, {"bad": torch.ones(2, dtype=torch.complex32)})
    with pytest.raises(ckpt.CheckpointError):
        manager.close()  # the error of step 3's write is not lost at close either


def test_one_manager_per_root_and_startup_cleanup(tmp_path):
    stale = tmp_path / "step-00000007.tmp-deadbeef0000"
    (stale / "data").mkdir(parents=True)
    half_deleted = tmp_path / "step-00000003"
    (half_deleted / "data").mkdir(parents=True)
    with CheckpointManager(tmp_path) as manager:
        assert not stale.exists() and not half_deleted.exists()
        with pytest.raises(ckpt.CheckpointLockedError):
            CheckpointManager(tmp_path)
        manager.save(1, {"x": torch.ones(1)})
    with CheckpointManager(tmp_path) as again:  # the lock is released at close
        assert again.steps() == [1]


def test_load_latest_falls_back_past_a_corrupt_checkpoint(tmp_path):
    with CheckpointManager(tmp_path, keep=5) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"x": torch.full((1000,), float(step)), "step": step})
    data = step_path(tmp_path, 3) / "data" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(raw)
    state = {"x": torch.zeros(1000), "step": 0}
    with CheckpointManager(tmp_path) as manager:
        with pytest.warns(UserWarning, match="step 3 cannot be loaded"):
            assert manager.load(state) == 2
        assert state["step"] == 2 and torch.equal(state["x"], torch.full((1000,), 2.0))
        with pytest.raises(ckpt.CorruptCheckpointError):
            manager.load(state, step=3)


def test_empty_root_loads_nothing(tmp_path):
    with CheckpointManager(tmp_path / "new") as manager:
        assert manager.load({"x": torch.zeros(1)}) is None and manager.steps() == []


def _fsdp_manager_run(rank: int, world: int, root: str):
    model = models.parallelize(models.build(), "fsdp")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with CheckpointManager(root, interval=1, keep=3) as manager:
        manager.attach(optim)
        expected = {}
        for step in range(1, 4):
            models.train_step(model, optim, seed=step)
            manager.save(step, {"model": model, "optim": optim, "step": step})
            expected[step] = models.full_state(model, optim)
        fresh = models.parallelize(models.build(seed=8), "fsdp")
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        state = {"model": fresh, "optim": fresh_optim, "step": 0}
        assert manager.load(state) == 3 and state["step"] == 3
        models.assert_same(models.full_state(fresh, fresh_optim), expected[3])
        assert manager.load(state, step=2) == 2
        models.assert_same(models.full_state(fresh, fresh_optim), expected[2])
    return committed_steps(root)


def test_manager_on_two_fsdp_ranks(tmp_path):
    assert run_ranks(2, _fsdp_manager_run, str(tmp_path)) == [[1, 2, 3]] * 2


def test_save_adds_to_the_in_flight_set_while_retention_lists_it(tmp_path):
    """The writer thread lists the saves in flight (retention must not delete them) while save()
    on the training thread adds one. Provoked deterministically: a save's future whose done() -
    asked while the list is taken - waits until the training thread has started another save."""
    from concurrent.futures import Future

    listing, added = threading.Event(), threading.Event()

    class StallingFuture(Future):
        def done(self):
            listing.set()
            added.wait(timeout=60)
            return super().done()

    state = {"w": torch.randn(64, 64)}
    with CheckpointManager(tmp_path, keep=5) as manager:
        stalled = StallingFuture()
        manager._inflight[-1] = stalled  # asked about by step 1's retention pass
        manager.save(1, state)
        assert listing.wait(timeout=60), "retention never listed the saves in flight"
        manager.save(2, state)  # adds step 2 while the writer thread is in the middle of that list
        added.set()
        stalled.set_result(None)
        manager._inflight.pop(-1)
        manager.wait()  # before the fix: CheckpointWriteError (dictionary changed size during iteration)
    assert committed_steps(tmp_path) == [1, 2]

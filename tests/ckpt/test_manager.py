"""CheckpointManager: exact snapshots under mutation, interval and force, backpressure (skip/block),
background errors, locking, start-up clean-up, fallback, and the same on 2 FSDP2 ranks."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from torch import nn

import ckpt
from ckpt.manager import CheckpointManager
from ckpt.root import committed_steps
from tests.support.checkpoints import step_path
from tests.support import models
from tests.support.launch import run_ranks


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


def test_a_constructor_that_fails_lets_go_of_the_root(tmp_path):
    """A manager that cannot start (here: its memory folder cannot be made) raises and holds nothing:
    the same process opens the root again with the option fixed (the lock was left held before)."""
    with pytest.raises(ckpt.InvalidOptionError, match="memory"):
        CheckpointManager(tmp_path / "ckpt", memory=str(tmp_path / "missing" / "shm"))
    with CheckpointManager(tmp_path / "ckpt", memory=str(tmp_path / "shm")) as manager:
        manager.save(1, {"x": torch.ones(1)}, force=True)
        manager.wait()
        assert manager.steps() == [1]


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
        with pytest.raises(ckpt.CheckpointNotFoundError, match=r"step 3 was set aside as damaged: step-00000003\.damaged-"):
            manager.load(state, step=3)  # damaged everywhere: the fallback set it aside


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


@pytest.mark.slow
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
        manager._pipeline.inflight.add(-1, stalled)  # asked about by step 1's retention pass
        manager.save(1, state)
        assert listing.wait(timeout=60), "retention never listed the saves in flight"
        manager.save(2, state)  # adds step 2 while the writer thread is in the middle of that list
        added.set()
        stalled.set_result(None)
        manager._pipeline.inflight.remove(-1)
        manager.wait()  # before the fix: CheckpointWriteError (dictionary changed size during iteration)
    assert committed_steps(tmp_path) == [1, 2]


def _two_tensor_steps(root, steps=(1, 2)):
    expected = {}
    with CheckpointManager(root, keep=5) as manager:
        for step in steps:
            state = {"a": torch.full((256,), float(step)), "b": torch.full((256,), -float(step)),
                     "extra": {"loader": {"position": 10 * step}}}
            manager.save(step, state)
            expected[step] = {"a": state["a"].clone(), "b": state["b"].clone(), "position": 10 * step}
    return expected


def _flip_last_chunk(path):
    manifest = ckpt.read_manifest(path)
    blob = max((c.blob for e in manifest.tensors.values() for c in e.chunks), key=lambda b: b.offset)
    data = path / blob.file
    raw = bytearray(data.read_bytes())
    raw[blob.offset + blob.length - 1] ^= 0x01
    data.write_bytes(raw)


def test_after_a_failed_load_the_fallback_loads_the_older_step_completely(tmp_path):
    """A checksum failure in the last chunk of step 2 comes after earlier chunks were copied into
    the live tensors; the manager then loads step 1 in full, so nothing of step 2 remains."""
    expected = _two_tensor_steps(tmp_path)
    _flip_last_chunk(step_path(tmp_path, 2))
    loader = {"position": -1}
    state = {"a": torch.zeros(256), "b": torch.zeros(256), "extra": {"loader": loader}}
    with CheckpointManager(tmp_path) as manager, pytest.warns(UserWarning, match="falling back"):
        assert manager.load(state) == 1
    assert torch.equal(state["a"], expected[1]["a"]) and torch.equal(state["b"], expected[1]["b"])
    assert loader["position"] == 10  # the user's own dict, updated in place


def test_when_no_step_loads_the_manager_raises_instead_of_starting_over(tmp_path):
    """It used to return None ("nothing to resume") over a state the failed loads had touched."""
    _two_tensor_steps(tmp_path)
    for step in (1, 2):
        _flip_last_chunk(step_path(tmp_path, step))
    state = {"a": torch.zeros(256), "b": torch.zeros(256), "extra": {"loader": {"position": -1}}}
    with CheckpointManager(tmp_path) as manager, pytest.warns(UserWarning, match="falling back"):
        with pytest.raises(ckpt.CorruptCheckpointError, match="no checkpoint .* can be loaded"):
            manager.load(state)


def test_a_missing_step_lists_the_committed_ones(tmp_path):
    _two_tensor_steps(tmp_path)
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(ckpt.CheckpointNotFoundError, match="step 7 .*committed steps: 1, 2"):
            manager.load({"a": torch.zeros(256), "b": torch.zeros(256), "extra": None}, step=7)


def test_the_readme_loader_dict_pattern_resumes_the_position(tmp_path):
    """README: state = {..., "extra": {"loader": loader_state}}; after load, loader_state - the
    object the training loop keeps using - holds the saved position (it was replaced by a copy)."""
    loader_state = {"position": 0}
    with CheckpointManager(tmp_path) as manager:
        loader_state["position"] = 4096
        manager.save(1, {"w": torch.ones(4), "extra": {"loader": loader_state}})
    loader_state = {"position": 0}
    state = {"w": torch.zeros(4), "extra": {"loader": loader_state}}
    with CheckpointManager(tmp_path) as manager:
        assert manager.load(state) == 1
    assert loader_state["position"] == 4096 and state["extra"]["loader"] is loader_state


def test_on_error_continue_warns_counts_and_retries(tmp_path, monkeypatch):
    original = CheckpointManager._write
    failing = {2}

    def write(manager, step, tree, base=None):
        if step in failing:
            raise OSError(28, "No space left on device")
        return original(manager, step, tree, base)

    monkeypatch.setattr(CheckpointManager, "_write", write)
    for mode in ("double_buffer", "sync"):
        root = tmp_path / mode
        with CheckpointManager(root, on_error="continue", async_mode=mode, full_every=1) as manager:
            with pytest.warns(UserWarning, match="No space left"):
                for step in (1, 2, 3):
                    manager.save(step, {"w": torch.full((4,), float(step))})
                manager.wait()
            assert manager.stats.failures == 1
        assert committed_steps(root) == [1, 3]
    with pytest.raises(ckpt.CheckpointWriteError, match="No space left"):
        with CheckpointManager(tmp_path / "stop") as manager:  # the default: stop
            for step in (1, 2, 3):
                manager.save(step, {"w": torch.full((4,), float(step))})


def test_a_delta_queued_on_a_write_that_fails_is_stored_whole(tmp_path, monkeypatch):
    """Step 2 is staged as a delta on step 1 while step 1 is still being written; step 1's write
    then fails. Step 2 must not be committed as a delta of a checkpoint that does not exist."""
    gate = _Gate(monkeypatch)
    original = CheckpointManager._write

    def write(manager, step, tree, base=None):
        if step == 1:
            raise OSError(5, "Input/output error")
        return original(manager, step, tree, base)

    monkeypatch.setattr(CheckpointManager, "_write", write)
    with CheckpointManager(tmp_path, full_every=4, on_error="continue") as manager:
        manager.save(1, {"w": torch.ones(64)})
        manager.save(2, {"w": torch.ones(64) * 2})
        gate.open.set()
        with pytest.warns(UserWarning, match="Input/output error"):
            manager.wait()
    assert committed_steps(tmp_path) == [2]
    assert ckpt.read_manifest(step_path(tmp_path, 2)).kind == "full"
    out = {"w": torch.zeros(64)}
    ckpt.load(out, step_path(tmp_path, 2))
    assert torch.equal(out["w"], torch.ones(64) * 2)


def _one_rank_notices_first(rank: int, world: int, root: str):
    """Step 1's write fails (on both ranks: DCP writes are collective). Rank 1 learns of it right
    away, rank 0 only later; at the next due save both must raise, neither may wait for the other."""
    import torch.distributed as dist

    with CheckpointManager(root, interval=2, keep=5) as manager:
        manager.save(1, {"bad": torch.ones(2, dtype=torch.complex32)}, force=True)  # no storable dtype
        if rank == 1:
            manager._pipeline.inflight.drain()  # rank 1 has the error in hand; rank 0 may not yet
        dist.barrier()
        try:
            manager.save(2, {"w": torch.ones(4)})
        except ckpt.CheckpointError as exc:
            return type(exc).__name__
        finally:
            manager._pipeline.failures.clear()
    return None


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_failed_save_is_raised_on_every_rank_at_the_same_step(tmp_path):
    assert run_ranks(2, _one_rank_notices_first, str(tmp_path)) == ["UnsupportedFormatError"] * 2


def test_failure_warnings_point_at_the_callers_line(tmp_path, monkeypatch):
    def write(manager, step, tree, base=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointManager, "_write", write)
    with CheckpointManager(tmp_path, on_error="continue") as manager:
        manager.save(1, {"w": torch.ones(2)})
        with pytest.warns(UserWarning, match="No space left") as record:
            manager.wait()
    assert record[0].filename == __file__


def test_attach_waits_before_a_forward_that_changes_buffers(tmp_path, monkeypatch):
    """BatchNorm updates its running statistics in forward, before any optimizer step: with
    ``attach(model=...)`` the snapshot is waited for before such a forward, and only there."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(tmp_path, interval=1, keep=2) as manager:
        waits = []
        wait_for_snapshot = manager._pipeline.before_step  # what the hooks call

        def counted() -> None:  # still waits: a forward must not race the snapshot it counts
            waits.append(True)
            wait_for_snapshot()

        monkeypatch.setattr(manager._pipeline, "before_step", counted)
        manager.attach(optim, model=model)
        state = {"model": model, "optim": optim}
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        manager.save(1, state)
        waits.clear()  # DCP's state_dict steps a fresh optimizer once (its pre-hook fired)
        model(torch.randn(4, 8)).sum().backward()  # changes running_mean/var in place
        assert waits == [True]  # the BatchNorm's forward, not the Linears'
        optim.step()
        assert len(waits) == 2
        monkeypatch.undo()
        manager.wait()
    out = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    ckpt.load({"model": out, "optim": torch.optim.SGD(out.parameters(), lr=0.1)}, step_path(tmp_path, 1))
    assert all(torch.equal(out.state_dict()[k], v) for k, v in expected.items())


def test_a_model_without_persistent_buffers_gets_no_forward_hook(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.register_buffer("cache", torch.zeros(3), persistent=False)  # like the llama's rope tables
    with CheckpointManager(tmp_path, interval=1) as manager:
        manager.attach(model=model)
        assert not manager._pipeline.hooks


def test_discard_after_leaves_one_history_on_every_mount(tmp_path):
    """A branch from step 1: steps 2 and 3 go on the primary and on the replica (replicated by an
    earlier manager), newest first; the catalog forgets them."""
    primary, replica = tmp_path / "primary", tmp_path / "replica"
    with CheckpointManager(primary, interval=1, keep=5, replicas=[str(replica)]) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.full((4,), float(step))})
    assert ckpt.CheckpointRoot(replica).steps() == [1, 2, 3]  # close() waited for the copies
    with CheckpointManager(primary, interval=1, keep=5, replicas=[str(replica)]) as manager:
        assert manager.discard_after(1) == [2, 3]
        assert manager.steps() == [1]
        assert manager.discard_after(1) == []
    assert ckpt.CheckpointRoot(primary).steps() == [1] and ckpt.CheckpointRoot(replica).steps() == [1]


def test_a_replica_copy_in_flight_never_commits_a_step_a_branch_deleted(tmp_path, monkeypatch):
    """A catch-up copy of step 2 to the replica has read the primary's step (parked here with what
    it read) when discard_after(1) begins: the branch waits for the copy, then deletes the step on
    both mounts — the copy never commits it after the deletions (seen once in a full run: the
    replica left holding [1, 2])."""
    from ckpt.root import replicate, retention
    from ckpt.storage import locate

    primary, replica = tmp_path / "primary", tmp_path / "replica"
    with CheckpointManager(primary, interval=1, keep=5, replicas=[str(replica)]) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.full((4,), float(step))})
    retention.discard_after(ckpt.CheckpointRoot(replica), 1)  # the next manager catches 2 and 3 up
    read, release = threading.Event(), threading.Event()

    def parked_copy(source, target, **kwargs):
        if not read.is_set():  # the first copy, step 2: what it read, then parked before committing
            snapshot = tmp_path / "read" / source.name
            shutil.copytree(str(source), snapshot)
            read.set()
            assert release.wait(120)
            source = locate(snapshot)
        return real_copy(source, target, **kwargs)

    class Announced:  # the branch's wait for copies in flight releases the parked copy
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if threading.current_thread() is threading.main_thread():
                release.set()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    real_copy = replicate.copy_step
    monkeypatch.setattr(replicate, "copy_step", parked_copy)
    with CheckpointManager(primary, interval=1, keep=5, replicas=[str(replica)]) as manager:
        manager._replicator.branching = Announced(manager._replicator.branching)
        assert read.wait(120)
        assert manager.discard_after(1) == [2, 3]
        release.set()  # a branch that did not wait: the copy commits step 2 only now
    assert ckpt.CheckpointRoot(primary).steps() == [1] and ckpt.CheckpointRoot(replica).steps() == [1]


def test_a_resume_parses_the_manifest_it_loads_once_and_never_a_stale_one(tmp_path, monkeypatch):
    import ckpt.read.committed as committed

    parsed = []
    real = committed.read_manifest_bytes

    def counting(path):
        parsed.append(path.name)
        return real(path)

    with CheckpointManager(tmp_path / "run", async_mode="sync", keep=3) as manager:
        for step in (1, 2):
            manager.save(step, {"w": torch.full((4,), float(step))})
    monkeypatch.setattr(committed, "read_manifest_bytes", counting)
    with CheckpointManager(tmp_path / "run", async_mode="sync", keep=3) as manager:
        state = {"w": torch.zeros(4)}
        assert manager.load(state) == 2 and torch.equal(state["w"], torch.full((4,), 2.0))
        assert parsed.count("step-00000002") == 1  # listed, then loaded from that same read
        assert manager.manifest(2).step == 2 and parsed.count("step-00000002") == 1
        manager.save(2, {"w": torch.full((4,), 7.0)}, force=True)  # step 2 rewritten by this manager
        assert manager.load(state) == 2 and torch.equal(state["w"], torch.full((4,), 7.0))


def test_a_step_directory_replaced_behind_the_root_is_read_again(tmp_path):
    import shutil

    from ckpt.root import CheckpointRoot

    with CheckpointManager(tmp_path / "run", async_mode="sync") as manager:
        manager.save(3, {"w": torch.ones(2)})
    root = CheckpointRoot(tmp_path / "run")
    assert root.steps() == [3] and root.manifest(3).tensors["w"].chunks[0].sizes == (2,)
    ckpt.save({"w": torch.ones(5)}, tmp_path / "other")
    shutil.rmtree(tmp_path / "run" / "step-00000003")
    shutil.move(tmp_path / "other", tmp_path / "run" / "step-00000003")  # a new directory there
    assert root.manifest(3).tensors["w"].chunks[0].sizes == (5,)

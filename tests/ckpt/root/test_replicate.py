"""ckpt.root.replicate: replication to other mounts in the background — a local primary, a second
directory standing in for a shared file system, and an S3 replica on a real S3-protocol server behind
a loopback proxy that can cut the connection; retention and start-up clean-up on every replica."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.root import CheckpointRoot
from ckpt.root.replicate import COMMITTED
from ckpt.storage import locate
from tests.support.checkpoints import flip_byte, step_path
from tests.support.launch import run_ranks
from tests.support.replicas import FAST_RETRY
from tests.support.replicas import blank as _blank
from tests.support.replicas import train as _train
from tests.support.replicas import verify_every_blob as _verify_every_blob


def _wait_committed(manager, steps, mounts: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = manager.replication_status()
        if all(len(status.get(s, {})) == mounts and set(status[s].values()) == {COMMITTED} for s in steps):
            return
        time.sleep(0.05)
    raise AssertionError(f"replication did not finish: {manager.replication_status()}")


def test_steps_reach_every_mount_and_an_s3_outage_is_caught_up(tmp_path, s3_bucket, s3_proxy, caplog):
    caplog.set_level(logging.INFO, logger="ckpt")
    primary, shared = tmp_path / "nvme", tmp_path / "shared"
    s3 = f"{s3_bucket.url}/run"
    with ckpt.CheckpointManager(primary, interval=1, keep=2, full_every=2, replicas=[str(shared), s3],
                                storage_options=s3_proxy.storage_options, **FAST_RETRY) as manager:
        _train(manager, [1, 2])
        manager.wait()
        _wait_committed(manager, [1, 2], mounts=2)
        s3_proxy.drop()  # the object store goes away during replication
        _train(manager, [3, 4], seed0=1)
        manager.wait()
        deadline = time.monotonic() + 30
        while "failed" not in manager.replication_status().get(3, {}).values() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager.replication_status()[3][s3] == "failed"
        s3_proxy.restore()
        _wait_committed(manager, [3, 4], mounts=2)
    for mount in (shared, s3):
        root = CheckpointRoot(mount, s3_bucket.storage_options)
        assert root.steps() == [3, 4]  # retention applied there too (4 is a delta on 3)
        for step in root.steps():
            _verify_every_blob(root.step_path(step))
            assert ckpt.read_manifest(root.step_path(step)).to_json() == \
                ckpt.read_manifest(step_path(primary, step)).to_json()
    lines = [r.getMessage() for r in caplog.records if r.name == "ckpt.root.replicate" and "step 3:" in r.getMessage()]
    assert any("failed" in line for line in lines) and lines[-1].endswith("committed")


@pytest.mark.slow
def test_close_waits_up_to_its_timeout_and_the_next_manager_catches_up(tmp_path, s3_bucket, s3_proxy):
    primary, s3 = tmp_path / "a", f"{s3_bucket.url}/late"
    s3_proxy.drop()
    with ckpt.CheckpointManager(primary, interval=1, keep=2, replicas=[s3], storage_options=s3_proxy.storage_options,
                                close_timeout=0.5, replica_backlog=1, **FAST_RETRY) as manager:
        _train(manager, [1, 2, 3])
        manager.wait()
    status = manager.replication_status()
    assert status[3][s3] == "pending" and "dropped" in (status[1][s3], status[2][s3])  # backlog of 1
    s3_proxy.restore()
    with ckpt.CheckpointManager(primary, interval=1, keep=2, replicas=[s3], storage_options=s3_proxy.storage_options,
                                **FAST_RETRY) as manager:
        _wait_committed(manager, [2, 3], mounts=1)
    assert CheckpointRoot(s3, s3_bucket.storage_options).steps() == [2, 3]


def _saved_then_held(primary: Path, s3_proxy, options: dict, monkeypatch) -> dict:
    """Steps 1-2 saved and copied to the S3 replica; then the catalog lost (rebuilt at the next start,
    from every mount) and the replica holding every request: it accepts connections and answers
    nothing (a host gone from the network: with s3fs's defaults minutes of timeouts and retries per
    call; with the tests' options 2 attempts x 5 s of read timeout). The states saved, by step."""
    with ckpt.CheckpointManager(primary, **options) as manager:
        saved = _train(manager, [1, 2])
        manager.wait()
        _wait_committed(manager, [1, 2], mounts=1)
    shutil.rmtree(primary / ".catalog")
    monkeypatch.setattr("ckpt.root.answer.REPLICA_WAIT_S", 1.0)  # the held replica answers nothing, ever
    s3_proxy.hold()
    return saved


def _restart_in_background(primary: Path, options: dict, step: int | None = None) -> tuple[threading.Thread, dict]:
    """A restart (the manager's start and its load, of ``step`` or the newest) on a thread: the
    thread and, once it is done, its manager, the step loaded and the state."""
    restarted: dict = {}

    def restart() -> None:
        restarted["manager"] = ckpt.CheckpointManager(primary, **options)
        state = _blank()
        restarted["step"], restarted["state"] = restarted["manager"].load(state, step), state

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    return thread, restarted


def test_a_replica_that_does_not_answer_holds_up_no_restart(tmp_path, s3_bucket, s3_proxy, caplog, monkeypatch):
    """The restart opens its root and loads the primary's newest step without waiting for the held
    replica: it is passed over 1 s (5 s outside the tests) after the primary answered, one line at
    the catalog's rebuild and one at the resume, where it used to be waited for ("cannot be listed"
    after the timeouts). Then the replica answers again and the run goes on as before."""
    caplog.set_level(logging.WARNING, logger="ckpt")
    primary, s3 = tmp_path / "nvme", f"{s3_bucket.url}/run"
    options = dict(interval=1, keep=3, replicas=[s3], storage_options=s3_proxy.storage_options, **FAST_RETRY)
    saved = _saved_then_held(primary, s3_proxy, options, monkeypatch)
    thread, restarted = _restart_in_background(primary, options)
    thread.join(120)  # a hang guard, not a timing: the held replica would answer nothing for minutes
    s3_proxy.forward()
    if thread.is_alive():
        thread.join()
        raise AssertionError("the restart waited for a replica that answered nothing")
    assert restarted["step"] == 2 and torch.equal(restarted["state"]["w"], saved[2]["w"])
    said = [r.getMessage() for r in caplog.records if "has not answered" in r.getMessage()]
    assert len(said) == 2 and all(s3 in line for line in said)  # the catalog's rebuild, then the resume
    with restarted["manager"] as manager:  # the replica is back: new steps reach it
        _train(manager, [3], seed0=2)
        manager.wait()
        _wait_committed(manager, [3], mounts=1)


@pytest.mark.parametrize("step", [None, 2], ids=["newest", "load_step"])
def test_a_damaged_primary_copy_waits_for_the_replica_passed_over(step, tmp_path, s3_bucket, s3_proxy, caplog,
                                                                 monkeypatch):
    """The double fault: the primary's newest copy is damaged while the replica does not answer. The
    restart passes the replica over, the primary's copy fails, and then it asks the replica however
    long it takes (one line saying so), rather than falling back to an older step or failing: once
    the replica answers, step 2 loads from it, bitwise. The damaged copy is not set aside (a good
    copy exists). The same for an explicit ``load(step=2)``."""
    caplog.set_level(logging.WARNING, logger="ckpt")
    primary, s3 = tmp_path / "nvme", f"{s3_bucket.url}/run"
    options = dict(interval=1, keep=3, replicas=[s3], storage_options=s3_proxy.storage_options, **FAST_RETRY)
    saved = _saved_then_held(primary, s3_proxy, options, monkeypatch)
    flip_byte(step_path(primary, 2), largest=True)
    with pytest.warns(UserWarning, match="loaded from replica"):
        thread, restarted = _restart_in_background(primary, options, step)
        for _ in range(1200):  # until the restart says it waits for the replica (bounded: 120 s)
            if any("asking the replicas passed over" in r.getMessage() for r in caplog.records):
                break
            thread.join(0.1)
        s3_proxy.forward()  # the replica answers again
        thread.join(120)
    assert not thread.is_alive()
    assert restarted["step"] == 2 and torch.equal(restarted["state"]["w"], saved[2]["w"])
    assert any("asking the replicas passed over" in r.getMessage() for r in caplog.records)
    assert any(f"loaded from replica {s3}" in r.getMessage() for r in caplog.records)
    assert step_path(primary, 2).exists()  # not set aside: the replica had a good copy
    restarted["manager"].close()


class _SignalledJoin:
    """A worker thread whose ``join`` first sets ``joined``: the close calling it has set its deadline."""

    def __init__(self, thread: threading.Thread, joined: threading.Event):
        self.thread, self.joined = thread, joined

    def join(self, *args) -> None:
        self.joined.set()
        self.thread.join(*args)

    def __getattr__(self, name: str):
        return getattr(self.thread, name)


def test_a_close_whose_time_is_up_starts_no_new_call_to_the_replica(tmp_path, s3_bucket, s3_proxy, monkeypatch):
    """``close()`` (``close_timeout`` 0) while the replication thread's claim of the S3 replica is
    held (the replica answers nothing): once that call returns, the thread starts no other — no
    catch-up listing, nothing queued: step 3, missing there, is left for the next manager, which
    copies it. Before, the catch-up listing and its queueing followed the deadline, each one more
    call that can take a silent host's timeouts and retries past ``close_timeout``."""
    primary, s3 = tmp_path / "nvme", f"{s3_bucket.url}/run"
    options = dict(interval=1, keep=5, replicas=[s3], storage_options=s3_proxy.storage_options, **FAST_RETRY)
    with ckpt.CheckpointManager(primary, **options) as manager:
        _train(manager, [1, 2])
        manager.wait()
        _wait_committed(manager, [1, 2], mounts=1)
    with ckpt.CheckpointManager(primary, interval=1, keep=5) as manager:  # step 3 on the primary alone
        _train(manager, [3], seed0=2)
    monkeypatch.setattr("ckpt.root.answer.REPLICA_WAIT_S", 1.0)  # the catalog's rebuild: the replica passed over
    s3_proxy.hold()
    manager = ckpt.CheckpointManager(primary, **{**options, "close_timeout": 0})
    joined = threading.Event()
    (worker,) = manager._replicator.workers
    worker.thread = _SignalledJoin(worker.thread, joined)

    def release_once_closing() -> None:
        joined.wait(120)
        s3_proxy.forward()

    threading.Thread(target=release_once_closing, daemon=True).start()
    manager.close()
    assert 3 not in manager.replication_status()  # never queued: no call after the deadline
    with ckpt.CheckpointManager(primary, **options) as manager:  # the next manager catches up
        _wait_committed(manager, [3], mounts=1)


def _replicate_on_two_ranks(rank: int, world: int, primary: str, s3: str, options: dict) -> list[str]:
    with ckpt.CheckpointManager(primary, interval=1, keep=2, replicas=[s3], storage_options=options,
                                **FAST_RETRY) as manager:
        state = {f"w{rank}": torch.full((4, 8), float(rank)), "step": 0}  # each rank writes its own tensor
        for step in (1, 2):
            manager.before_step()
            state[f"w{rank}"] += 1
            manager.save(step, state)
    return sorted(locate(s3, options).storage.list(f"{locate(s3, options).path}/step-00000002/data"))


@pytest.mark.slow
def test_every_rank_uploads_what_it_wrote(tmp_path, s3_bucket):
    s3 = f"{s3_bucket.url}/ranks"
    listed = run_ranks(2, _replicate_on_two_ranks, str(tmp_path / "a"), s3, s3_bucket.storage_options)
    assert listed[0] == sorted(Path(p).name for p in (tmp_path / "a" / "step-00000002" / "data").iterdir())
    assert len(listed[0]) == 2 and listed[0] == listed[1]
    assert {n.split(".")[-2][-5:] for n in listed[0]} == {"00000", "00001"}
    for step in (1, 2):
        _verify_every_blob(CheckpointRoot(s3, s3_bucket.storage_options).step_path(step))


def test_a_replica_that_is_the_root_itself_is_refused(tmp_path):
    with pytest.raises(ckpt.InvalidOptionError, match="replicas"):
        ckpt.CheckpointManager(tmp_path / "run", replicas=[str(tmp_path / "run" / ".." / "run")])
    ckpt.CheckpointManager(tmp_path / "run").close()  # nothing held by the refused one


def test_a_stale_copy_of_an_abandoned_branch_is_replaced_by_the_primarys_step(tmp_path):
    """Issue 36 item 5: a replica out of reach during a branch keeps the old branch's steps 4-6; when
    it is back, its step 4 and 5 are not the primary's (another manifest) and are copied anew, the
    old steps built on them going first — never counted as already there."""
    primary, replica = tmp_path / "primary", tmp_path / "replica"
    with ckpt.CheckpointManager(primary, interval=1, keep=10, full_every=3, replicas=[str(replica)]) as manager:
        _train(manager, range(1, 7))  # 1 full, 2-3 deltas, 4 full, 5-6 deltas
    with ckpt.CheckpointManager(primary, interval=1, keep=10, full_every=3) as manager:  # the replica left out
        assert manager.discard_after(3) == [4, 5, 6]
        branch = _train(manager, [4, 5], seed0=99)
    with ckpt.CheckpointManager(primary, interval=1, keep=10, full_every=3, replicas=[str(replica)],
                                **FAST_RETRY) as manager:
        _wait_committed(manager, [4, 5], mounts=1)
    assert CheckpointRoot(replica).steps() == [1, 2, 3, 4, 5]
    for step in (1, 2, 3, 4, 5):
        assert (step_path(replica, step) / "manifest.json").read_bytes() == \
            (step_path(primary, step) / "manifest.json").read_bytes()
    live = {"w": torch.zeros(128, 64), "b": torch.zeros(64), "step": -1}
    ckpt.load(live, step_path(replica, 5))
    assert torch.equal(live["w"], branch[5]["w"]) and live["step"] == 5

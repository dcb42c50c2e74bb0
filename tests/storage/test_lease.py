"""ckpt.storage.lease: the writer lock of a root on an object store (a real S3-protocol server on
loopback) — a second manager is refused naming the holder, a lease left by a dead process on this
host is taken over."""

from __future__ import annotations

import os

import pytest

import ckpt
from ckpt.storage import locate


def test_two_managers_on_one_s3_root_the_second_is_refused_naming_the_holder(s3_bucket):
    root = f"{s3_bucket.url}/locked"
    with ckpt.CheckpointManager(root, storage_options=s3_bucket.storage_options):
        with pytest.raises(ckpt.CheckpointLockedError, match=f"pid {os.getpid()}") as info:
            ckpt.CheckpointManager(root, storage_options=s3_bucket.storage_options)
        assert "host " in str(info.value)
    with ckpt.CheckpointManager(root, storage_options=s3_bucket.storage_options):  # released at close
        pass


def test_a_lease_left_by_a_dead_process_on_this_host_is_taken_over(s3_bucket):
    import json
    import socket
    import subprocess
    import sys
    import time

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = locate(f"{s3_bucket.url}/stale/.lock", s3_bucket.storage_options)
    lock.storage.write_bytes(lock.path, json.dumps({"holder": "a dead one", "host": socket.gethostname(),
                                                    "pid": int(dead.stdout), "token": "x",
                                                    "renewed": time.time()}).encode())
    with ckpt.CheckpointManager(f"{s3_bucket.url}/stale", storage_options=s3_bucket.storage_options):
        pass


def test_the_losers_of_simultaneous_lease_races_get_checkpoint_locked_error_naming_the_holder(s3_bucket):
    """Issue 22: 7 of 30 simultaneous takers raised a bare StorageError; now exactly one holds the lease
    and every other one is refused with CheckpointLockedError naming a holder."""
    import threading

    from ckpt.storage.lease import LeaseLock

    for race in range(10):
        lock = locate(f"{s3_bucket.url}/race{race}/.lock", s3_bucket.storage_options)
        barrier, results = threading.Barrier(3), {}

        def take(name: str) -> None:
            barrier.wait()
            try:
                results[name] = LeaseLock(lock.storage, lock.path, holder=name)
            except Exception as exc:  # noqa: BLE001 - what escapes is the point
                results[name] = exc

        threads = [threading.Thread(target=take, args=(f"taker-{i}",)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        held = [name for name, result in results.items() if isinstance(result, LeaseLock)]
        refused = {name: result for name, result in results.items() if not isinstance(result, LeaseLock)}
        assert len(held) == 1, results
        for name, error in refused.items():
            assert isinstance(error, ckpt.CheckpointLockedError), (name, repr(error))
            assert "lock held by taker-" in str(error)
        results[held[0]].release()


_STALE_HOLDER = r"""
import json, sys
import torch
import ckpt
import ckpt.storage.lease as lease

root, options, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
lease.LEASE_SECONDS = seconds
manager = ckpt.CheckpointManager(root, storage_options=options, interval=1, keep=2, async_mode="sync", catalog="")
for step in (1, 2):
    manager.save(step, {"w": torch.full((64,), float(step)), "step": step})
print("saved", flush=True)
sys.stdin.readline()  # paused (SIGSTOP) around here, past its lease; then told to go on
errors = []
for step in (3, 4, 5, 6):
    try:
        manager.save(step, {"w": torch.full((64,), -float(step)), "step": step})
    except ckpt.CheckpointError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
try:
    manager.close()
except ckpt.CheckpointError as exc:
    errors.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(errors), flush=True)
"""


def _objects(bucket, prefix: str) -> dict[str, bytes]:
    from tests.support.s3server import bucket_objects

    return {key: data for key, data in bucket_objects(bucket, prefix).items() if not key.endswith("/.lock")}


@pytest.mark.slow
def test_a_holder_paused_past_its_lease_never_overwrites_or_deletes_what_the_new_holder_committed(
        s3_bucket, monkeypatch):
    """Issue 22 item 3: A paused (SIGSTOP) past its lease, B took the root and committed steps 3-5, A
    resumed (SIGCONT) and went on saving: B's step 3 was deleted by A's retention, 4 and 5 replaced by A's."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import torch

    import ckpt.storage.lease as lease
    from tests.support import REPO

    seconds = 2.0
    monkeypatch.setattr(lease, "LEASE_SECONDS", seconds)
    root = f"{s3_bucket.url}/fenced"
    a = subprocess.Popen([sys.executable, "-c", _STALE_HOLDER, root, json.dumps(s3_bucket.storage_options),
                          str(seconds)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert a.stdout.readline().strip() == "saved", a.stderr.read()
        a.send_signal(signal.SIGSTOP)
        time.sleep(seconds * 1.5)  # A's lease expires while it is paused
        with ckpt.CheckpointManager(root, storage_options=s3_bucket.storage_options, interval=1, keep=10,
                                    async_mode="sync", catalog="") as b:
            for step in (3, 4, 5):
                b.save(step, {"w": torch.full((64,), 100.0 + step), "step": step})
            committed_by_b = _objects(s3_bucket, "fenced/")
            a.send_signal(signal.SIGCONT)
            a.stdin.write("go\n")
            a.stdin.flush()
            out, err = a.communicate(timeout=120)
            assert _objects(s3_bucket, "fenced/") == committed_by_b  # A overwrote and deleted nothing
            b.save(6, {"w": torch.full((64,), 106.0), "step": 6})  # B still holds the root
        for step in (3, 4, 5, 6):
            live = {"w": torch.zeros(64), "step": -1}
            ckpt.load(live, f"{root}/step-{step:08d}", storage_options=s3_bucket.storage_options)
            assert torch.equal(live["w"], torch.full((64,), 100.0 + step)) and live["step"] == step
        errors = json.loads(out.strip().splitlines()[-1])
        assert errors and all(e.startswith("CheckpointLockedError") for e in errors), (errors, err)
        assert "lost the lock" in errors[0]
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()


def test_a_writer_that_lost_its_lease_before_the_commit_point_commits_nothing(s3_bucket, monkeypatch):
    """The fence at the commit point itself: the lease taken over while the data objects were being
    written; the manifest is not PUT, the new holder's record stays, nothing of the step is left."""
    import json
    import time

    import torch

    from ckpt.dcp import Writer

    root = f"{s3_bucket.url}/fence-commit"
    lock = locate(f"{root}/.lock", s3_bucket.storage_options)
    taken = {"holder": "host elsewhere pid 1", "host": "elsewhere", "pid": 1, "token": "theirs",
             "renewed": time.time()}
    real = Writer.write_data

    def write_then_lose(self, plan, planner):
        done = real(self, plan, planner)
        lock.storage.write_bytes(lock.path, json.dumps({**taken, "renewed": time.time()}).encode())
        return done

    with ckpt.CheckpointManager(root, storage_options=s3_bucket.storage_options, interval=1, async_mode="sync",
                                catalog="") as manager:
        manager.save(1, {"w": torch.ones(8)})
        monkeypatch.setattr(Writer, "write_data", write_then_lose)
        with pytest.raises(ckpt.CheckpointLockedError, match="lost the lock.*host elsewhere pid 1"):
            manager.save(2, {"w": torch.full((8,), 2.0)})
        monkeypatch.setattr(Writer, "write_data", real)
        with pytest.raises(ckpt.CheckpointLockedError, match="lost the lock"):
            manager.save(3, {"w": torch.full((8,), 3.0)})  # lost for good
        assert manager.steps() == [1]
        assert json.loads(lock.storage.read_bytes(root, ".lock", 1 << 16))["token"] == "theirs"
        assert not any(name.startswith("step-00000002") for name in locate(root, s3_bucket.storage_options).list())

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

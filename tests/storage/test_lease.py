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

"""ckpt.root.catalog.store: records and states, rebuild == incremental recording, automatic rebuilds (missing,
garbage, other schema, inconsistent with the primary), readers beside a writer, no credentials."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import pytest
import torch

import ckpt
from ckpt.root.catalog.store import Catalog, MountState, mount_id, open_catalog
from ckpt.errors import CheckpointError
from ckpt.storage import locate
from tests.support import REPO
from tests.support.s3server import TEST_KEY, TEST_SECRET

REPLICA = "s3://bucket/replica"


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 16, generator=gen), "b": torch.randn(5, generator=gen), "step": seed}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A root with steps 1..4: a full, two deltas, a full."""
    root = tmp_path_factory.mktemp("catalog") / "run"
    with ckpt.CheckpointManager(root, interval=1, full_every=3) as manager:
        for step in range(1, 5):
            manager.save(step, _state(step))
    return root


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _listing(catalog: Catalog) -> list:
    return [(i.step, i.kind, i.base_step, i.bytes, i.raw_bytes, i.tensors, i.created, i.mounts)
            for i in catalog.steps()]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    handler, logger = _Records(), logging.getLogger("ckpt.root.catalog.store")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_record_states_and_forget(run, tmp_path):
    primary = locate(run)
    with Catalog(tmp_path / "cat") as catalog:
        catalog.set_mounts([primary, REPLICA])
        assert catalog.mounts() == [str(run), REPLICA]
        manifests = {step: ckpt.read_manifest(run / f"step-{step:08d}") for step in (1, 2)}
        for step, manifest in manifests.items():
            catalog.record_commit(primary, step, manifest, when=100.0 + step)
        catalog.set_state(REPLICA, 1, "pending", when=5.0)
        catalog.set_state(REPLICA, 1, "copying", when=6.0)
        catalog.set_state(REPLICA, 2, "failed", when=7.0, detail="upload: connection reset")

        one, two = catalog.steps()
        assert (one.step, one.kind, one.base_step, one.tensors) == (1, "full", None, 2)
        assert (two.kind, two.base_step) == ("delta", 1)
        assert one.bytes == sum(c.blob.length for e in manifests[1].tensors.values() for c in e.chunks)
        assert two.raw_bytes > two.bytes  # deltas compress
        assert one.created == manifests[1].created
        assert one.mounts == {str(run): MountState("committed", 101.0), REPLICA: MountState("copying", 6.0)}
        assert two.mounts[REPLICA] == MountState("failed", 7.0, "upload: connection reset")
        assert catalog.step(2) == two and catalog.step(3) is None
        assert catalog.checksums(1) == {(key, c.offsets): c.blob.checksum
                                        for key, e in manifests[1].tensors.items() for c in e.chunks}
        with pytest.raises(ValueError):
            catalog.set_state(REPLICA, 1, "lost")

        catalog.forget(primary, 1)  # the replica is still copying it: the step stays
        assert catalog.step(1).mounts == {REPLICA: MountState("copying", 6.0)} and catalog.step(1).kind == "full"
        catalog.forget(primary, 2)  # only a failed copy is left: the step goes, with its chunks
        assert [i.step for i in catalog.steps()] == [1] and catalog.checksums(2) == {}


def test_rebuild_equals_incremental_recording(run, tmp_path):
    primary = locate(run)
    with Catalog(tmp_path / "incremental") as incremental, Catalog(tmp_path / "rebuilt") as rebuilt:
        incremental.set_mounts([primary])
        for step in range(1, 5):
            manifest = ckpt.read_manifest(run / f"step-{step:08d}")
            incremental.record_commit(primary, step, manifest, when=manifest.created)
        rebuilt.set_state(primary, 99, "pending")  # from scratch: this goes
        rebuilt.rebuild([primary])
        assert _listing(rebuilt) == _listing(incremental) and len(_listing(rebuilt)) == 4
        assert all(rebuilt.checksums(s) == incremental.checksums(s) for s in range(1, 5))
        assert rebuilt.is_consistent_with(primary) and rebuilt.mounts() == [str(run)]


def test_open_catalog_rebuilds_a_missing_catalog(run, tmp_path):
    primary = locate(run)
    path = tmp_path / "cat"
    with open_catalog(path, [primary]) as catalog:
        before = _listing(catalog)
    assert [row[0] for row in before] == [1, 2, 3, 4]
    shutil.rmtree(path)
    with open_catalog(path, [primary]) as catalog:
        assert _listing(catalog) == before


def test_open_catalog_rebuilds_garbage_and_other_schemas(run, tmp_path, warnings_logged):
    primary = locate(run)
    path = tmp_path / "cat"
    open_catalog(path, [primary]).close()
    (path / "data.mdb").write_bytes(b"not lmdb at all " * 1000)
    with open_catalog(path, [primary]) as catalog:
        assert [i.step for i in catalog.steps()] == [1, 2, 3, 4]
    assert len(warnings_logged) == 1 and "rebuilding" in warnings_logged[0]

    for key, value in ((b"meta/schema", b'{"version": 99}'), (b"step/000000000002", b"{half a rec")):
        env = lmdb.open(str(path))
        with env.begin(write=True) as txn:
            txn.put(key, value)
        env.close()
        with open_catalog(path, [primary]) as catalog:
            assert [i.step for i in catalog.steps()] == [1, 2, 3, 4] and catalog.step(2).kind == "delta"
    assert len(warnings_logged) == 3


def test_open_catalog_rebuilds_when_the_primary_changed_behind_its_back(run, tmp_path):
    root = _copy(run, tmp_path)
    primary = locate(root)
    path = Catalog.default_path(primary)
    assert path == str(root / ".catalog") and Catalog.default_path(locate(REPLICA)) is None
    open_catalog(path, [primary]).close()
    shutil.rmtree(root / "step-00000004")
    ckpt.save(_state(5), root / "step-00000005")
    with Catalog(path) as catalog:
        assert not catalog.is_consistent_with(primary)
    with open_catalog(path, [primary]) as catalog:
        assert [i.step for i in catalog.steps()] == [1, 2, 3, 5] and catalog.is_consistent_with(primary)


def test_unreadable_manifest_is_recorded_failed_and_stays_consistent(run, tmp_path):
    root = _copy(run, tmp_path)
    (root / "step-00000004" / "manifest.json").write_bytes(b"{")
    primary = locate(root)
    with open_catalog(tmp_path / "cat", [primary]) as catalog:
        state = catalog.step(4).mounts[str(root)]
        assert state.state == "failed" and "JSON" in state.detail and catalog.step(4).kind is None
        assert catalog.is_consistent_with(primary)  # listed, so no rebuild on every open


@pytest.mark.slow
def test_writer_threads_and_readers(run, tmp_path):
    """Writes from several threads all land; a reader in another process neither blocks on an open
    write transaction nor sees half a record while commits stream in."""
    manifest = ckpt.read_manifest(run / "step-00000001")
    path = tmp_path / "cat"
    catalog = Catalog(path)
    threads = [threading.Thread(target=lambda t=t: [catalog.record_commit(str(run), t * 100 + i, manifest)
                                                    for i in range(20)]) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(catalog.steps()) == 80

    reader = subprocess.Popen([sys.executable, "-c", _READER, str(path), str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        with catalog._write() as txn:  # a writer mid-transaction: the reader sees the old state
            txn.put(b"step/000000009999", b'{"half": true}')
            reader.stdin.write("once\n")
            reader.stdin.flush()
            assert reader.stdout.readline().split() == ["steps", "80"]
            txn.delete(b"step/000000009999")
        reader.stdin.write("loop\n")
        reader.stdin.flush()
        for i in range(60):
            catalog.record_commit(str(run), 1000 + i, manifest)
        catalog.set_state(str(run), 10**6, "pending")  # the reader's signal to stop
        assert reader.stdout.readline().split()[0] == "whole"
    finally:
        reader.stdin.close()
        assert reader.wait(60) == 0
        catalog.close()


_READER = """
import sys
from ckpt.root.catalog import Catalog
catalog = Catalog(sys.argv[1], readonly=True)
mount = sys.argv[2]
for command in sys.stdin:
    if command.strip() == "once":
        print("steps", len(catalog.steps()), flush=True)
        continue
    reads = 0
    while True:
        infos = catalog.steps()
        reads += 1
        for info in infos:
            if info.step == 10**6:
                print("whole", reads, flush=True)
                break
            state = info.mounts[mount]
            assert info.kind == "full" and info.tensors == 2 and state.state == "committed", info
            assert len(catalog.checksums(info.step)) == 2, info
        else:
            continue
        break
"""


def test_no_credentials_in_the_catalog(run, tmp_path, s3_bucket):
    url = f"{s3_bucket.url}/run"
    ckpt.save(_state(1), f"{url}/step-00000001", storage_options=s3_bucket.storage_options)
    replica = locate(url, s3_bucket.storage_options)
    assert mount_id(replica) == url
    path = tmp_path / "cat"
    with open_catalog(path, [locate(run), replica]) as catalog:
        assert catalog.mounts() == [str(run), url]
        assert catalog.step(1).mounts[url].state == "committed" and catalog.step(4).mounts.keys() == {str(run)}
        catalog.set_state(f"s3://{TEST_KEY}:{TEST_SECRET}@{s3_bucket.name}/run", 2, "copying")
        assert catalog.step(2).mounts[url].state == "copying"  # credentials in a URL text are dropped
    stored = b"".join(p.read_bytes() for p in path.iterdir())
    assert TEST_KEY.encode() not in stored and TEST_SECRET.encode() not in stored


def test_errors_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="cannot|No such"):
        Catalog(tmp_path / "absent", readonly=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError):
        Catalog(tmp_path / "file")
    with Catalog(tmp_path / "cat"), pytest.raises(CheckpointError, match="already open"):
        Catalog(tmp_path / "cat")  # py-lmdb refuses a second handle in one process
    assert os.path.isdir(tmp_path / "cat")


def test_a_refused_replica_shows_as_refused_in_ckpt_inspect(tmp_path, capsys):
    """Issue 36 item 10a: the replicator's `refused` (the mount is another run's) was not a catalog
    state, so the catalog dropped it and `ckpt inspect` showed the steps as `missing` there. One enum
    of replica states is shared by the replicator, the catalog and ckpt inspect."""
    import json
    import time

    from tests.support.replicas import FAST_RETRY
    from tests.support.replicas import train as _train
    from tools.inspection import main

    a, b = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(b, interval=1) as run_b:  # another run's root
        _train(run_b, [5])
    with ckpt.CheckpointManager(a, interval=1, replicas=[str(b)], **FAST_RETRY) as run_a:
        _train(run_a, [1, 2])
        run_a.wait()
        deadline = time.monotonic() + 30
        while set(run_a.replication_status().get(2, {}).values()) != {"refused"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run_a.replication_status() == {1: {str(b): "refused"}, 2: {str(b): "refused"}}
    with Catalog(Catalog.default_path(locate(a)), readonly=True) as catalog:
        assert catalog.step(2).mounts[str(b)].state == "refused"
    assert main([str(a), "--mount", str(b), "--json"]) == 0
    rows = {row["step"]: row["mounts"] for row in json.loads(capsys.readouterr().out)["steps"]}
    assert rows[1] == rows[2] == {str(a): "committed", str(b): "refused"}
    assert main([str(a), "--mount", str(b)]) == 0
    table = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert [row[-2:] for row in table if row[0] in ("1", "2")] == [["committed", "refused"]] * 2

    from ckpt.root import replicate  # one enum: every state the replicator sets, the catalog keeps
    from ckpt.root.replica_states import ReplicaState

    assert replicate.REFUSED is ReplicaState.REFUSED and set(ckpt.root.catalog.STATES) == set(ReplicaState)

"""Replication to other mounts and loading from them: a local primary, a second directory standing in
for a shared file system, and an S3 replica on a real S3-protocol server behind a loopback proxy that
can cut the connection."""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.catalog import Catalog
from ckpt.read import ChunkSource
from ckpt import replicate
from ckpt.replicate import COMMITTED, copy_step
from ckpt.root import CheckpointRoot
from ckpt.storage import locate
from tests.support.checkpoints import assert_state_equal, step_path
from tests.support.launch import run_ranks

FAST_RETRY = {"replica_retry_initial": 0.05, "replica_retry_max": 0.2}


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(128, 64, generator=gen), "b": torch.randn(64, generator=gen), "step": seed}


def _blank() -> dict:
    return {"w": torch.zeros(128, 64), "b": torch.zeros(64), "step": -1}


def _train(manager, steps, *, seed0=0) -> dict[int, dict]:
    """Save a slowly changing state at each step (deltas stay small); the states saved, by step."""
    state, saved = _state(seed0), {}
    for step in steps:
        manager.before_step()  # the last snapshot is complete before the state changes
        state["w"][step % 128] += 1.0
        state["step"] = step
        manager.save(step, state)
        saved[step] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return saved


def _verify_every_blob(location) -> None:
    with ChunkSource(location) as source:
        for key, entry in source.manifest.tensors.items():
            for chunk in entry.chunks:
                source.files.read(chunk.blob, what=key)


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
    lines = [r.getMessage() for r in caplog.records if r.name == "ckpt.replicate" and "step 3:" in r.getMessage()]
    assert any("failed" in line for line in lines) and lines[-1].endswith("committed")


def test_load_falls_back_to_a_replica_bitwise_when_the_primary_copy_is_bad(tmp_path):
    primary, replica = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(primary, interval=1, keep=5, replicas=[str(replica)], **FAST_RETRY) as manager:
        saved = _train(manager, [1, 2, 3])
    with Catalog(primary / ".catalog", readonly=True) as catalog:  # the manager's index of both mounts
        assert catalog.mounts() == [str(primary), str(replica)]
        assert [(i.step, i.kind, {m: s.state for m, s in i.mounts.items()}) for i in catalog.steps()] == \
            [(s, "full", {str(primary): "committed", str(replica): "committed"}) for s in (1, 2, 3)]
    data = step_path(primary, 3) / "data" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))  # corrupt on the primary
    shutil.rmtree(step_path(primary, 2))  # and gone there
    with ckpt.CheckpointManager(primary, replicas=[str(replica)]) as manager:
        live = _blank()
        with pytest.warns(UserWarning, match="step 3 loaded from replica"):
            assert manager.load(live) == 3
        assert_state_equal(live, saved[3])
        live = _blank()
        with pytest.warns(UserWarning, match="loaded from replica"):
            assert manager.load(live, step=2) == 2
        assert_state_equal(live, saved[2])


def test_no_good_copy_anywhere_falls_back_to_the_previous_step(tmp_path):
    primary, replica = tmp_path / "a", tmp_path / "b"
    with ckpt.CheckpointManager(primary, interval=1, keep=5, replicas=[str(replica)], **FAST_RETRY) as manager:
        saved = _train(manager, [1, 2])
    for root in (primary, replica):
        (step_path(root, 2) / "data" / "rank-00000.bin").write_bytes(b"garbage")
    with ckpt.CheckpointManager(primary, replicas=[str(replica)]) as manager:
        live = _blank()
        with pytest.warns(UserWarning, match="step 2 cannot be loaded"):
            assert manager.load(live) == 1
        assert_state_equal(live, saved[1])


def test_a_delta_chain_whose_links_live_on_different_mounts_loads_bitwise(tmp_path, s3_bucket):
    primary, s3 = tmp_path / "a", f"{s3_bucket.url}/chain"
    options = s3_bucket.storage_options
    with ckpt.CheckpointManager(primary, interval=1, keep=5, full_every=4, replicas=[s3],
                                storage_options=options, **FAST_RETRY) as manager:
        saved = _train(manager, [1, 2, 3])
    assert [ckpt.read_manifest(step_path(primary, s)).kind for s in (1, 2, 3)] == ["full", "delta", "delta"]
    replica = CheckpointRoot(s3, options)
    replica.delete(1)  # the full lives only on the primary
    shutil.rmtree(step_path(primary, 2))  # the middle link only on S3
    with ckpt.CheckpointManager(primary, replicas=[s3], storage_options=options, **FAST_RETRY) as manager:
        live = _blank()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # step 3 comes from the primary: no fallback warning
            assert manager.load(live) == 3  # link 2 from S3, link 1 from the primary
        assert_state_equal(live, saved[3])


def test_corruption_on_the_source_is_never_replicated(tmp_path):
    ckpt.save(_state(1), tmp_path / "a" / "step-00000001")
    data = tmp_path / "a" / "step-00000001" / "data" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        copy_step(locate(tmp_path / "a" / "step-00000001"), locate(tmp_path / "b" / "step-00000001"))
    assert info.value.file == "data/rank-00000.bin" and info.value.tensor in ("w", "b")
    assert CheckpointRoot(tmp_path / "b").committed() == [] and not any((tmp_path / "b").iterdir())


def test_read_back_finds_what_the_replica_damaged(tmp_path, monkeypatch):
    ckpt.save(_state(1), tmp_path / "a" / "step-00000001")
    copy = replicate.copy_file

    def copy_then_damage(source, target, name, blobs, size=None):
        written = copy(source, target, name, blobs, size)
        damaged = Path((target / name).path)
        raw = bytearray(damaged.read_bytes())
        raw[-1] ^= 0x01  # the replica's mount flips a bit after the write reported success
        damaged.write_bytes(bytes(raw))
        return written

    monkeypatch.setattr(replicate, "copy_file", copy_then_damage)
    source = locate(tmp_path / "a" / "step-00000001")
    copy_step(source, locate(tmp_path / "b" / "step-00000001"))  # without read-back: committed as written
    assert CheckpointRoot(tmp_path / "b").committed() == [1]
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        copy_step(source, locate(tmp_path / "c" / "step-00000001"), read_back=True)
    assert info.value.file == "data/rank-00000.bin" and info.value.tensor in ("w", "b")
    assert CheckpointRoot(tmp_path / "c").committed() == []


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


def test_two_managers_on_one_root_the_second_is_refused_naming_the_holder(tmp_path):
    import os

    with ckpt.CheckpointManager(tmp_path / "run"):
        with pytest.raises(ckpt.CheckpointLockedError, match=f"host .* pid {os.getpid()}"):
            ckpt.CheckpointManager(tmp_path / "run")


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

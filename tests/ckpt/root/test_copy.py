"""ckpt.root.copy: one committed step copied to another mount, every blob verified as it streams;
corruption on the source is never committed, a read-back finds what the target damaged."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt
from ckpt.root import CheckpointRoot, copy_step
from ckpt.root import copy as root_copy
from ckpt.storage import locate
from tests.support.replicas import state as _state


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
    copy = root_copy.copy_file

    def copy_then_damage(source, target, name, blobs, size=None, progress=None):
        written = copy(source, target, name, blobs, size, progress)
        damaged = Path((target / name).path)
        raw = bytearray(damaged.read_bytes())
        raw[-1] ^= 0x01  # the replica's mount flips a bit after the write reported success
        damaged.write_bytes(bytes(raw))
        return written

    monkeypatch.setattr(root_copy, "copy_file", copy_then_damage)
    source = locate(tmp_path / "a" / "step-00000001")
    copy_step(source, locate(tmp_path / "b" / "step-00000001"))  # without read-back: committed as written
    assert CheckpointRoot(tmp_path / "b").committed() == [1]
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        copy_step(source, locate(tmp_path / "c" / "step-00000001"), read_back=True)
    assert info.value.file == "data/rank-00000.bin" and info.value.tensor in ("w", "b")
    assert CheckpointRoot(tmp_path / "c").committed() == []


def test_a_checksum_mismatch_while_copying_is_retried_from_the_source(tmp_path, s3_bucket, monkeypatch):
    """Issue 22 item 13: one corrupted read during replication to S3 marked the step "dropped" for good
    although it is intact on the primary; only a source that fails verification again is final."""
    import time

    from tests.support.replicas import FAST_RETRY
    from tests.support.replicas import train as _train

    damaged = []

    class OnceCorrupt:  # the first data read of the replicator comes back with one bit flipped
        def __init__(self, handle):
            self.handle, self.size = handle, handle.size

        def read_into(self, buffer, offset):
            got = self.handle.read_into(buffer, offset)
            if not damaged and got:
                buffer[got // 2] ^= 0x01
                damaged.append(offset)
            return got

        def close(self):
            self.handle.close()

    class Files(root_copy.DataFiles):
        def open(self, name):
            return OnceCorrupt(super().open(name))

    monkeypatch.setattr(root_copy, "DataFiles", Files)
    replica = f"{s3_bucket.url}/run"
    with ckpt.CheckpointManager(tmp_path / "a", interval=1, replicas=[replica],
                                storage_options=s3_bucket.storage_options, **FAST_RETRY) as manager:
        saved = _train(manager, [1])
        manager.wait()
        deadline = time.monotonic() + 30
        while manager.replication_status().get(1, {}).get(replica) not in ("committed", "dropped") \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert damaged and manager.replication_status()[1][replica] == "committed"
    live = {k: (v.clone().zero_() if hasattr(v, "clone") else -1) for k, v in saved[1].items()}
    ckpt.load(live, f"{replica}/step-00000001", storage_options=s3_bucket.storage_options)
    assert all((live[k] == v).all() if hasattr(v, "clone") else live[k] == v for k, v in saved[1].items())


def test_a_target_committed_with_another_manifest_is_refused_not_counted_as_done(tmp_path):
    """Issue 36 item 5: copy_step counted any committed target as done, so a replica's step of an
    abandoned branch stood for the primary's step of the same number. Done means the same manifest."""
    source, other = locate(tmp_path / "a" / "step-00000001"), locate(tmp_path / "b" / "step-00000001")
    ckpt.save(_state(1), source)
    ckpt.save(_state(2), other)  # step 1 of another history
    before = (Path(other.path) / "manifest.json").read_bytes()
    with pytest.raises(ckpt.CheckpointError, match="another manifest") as info:
        copy_step(source, other)
    assert type(info.value).__name__ == "TargetConflictError" and "digest" in str(info.value) and str(other) in str(info.value)
    assert (Path(other.path) / "manifest.json").read_bytes() == before  # nothing committed is replaced
    same = locate(tmp_path / "c" / "step-00000001")
    assert copy_step(source, same) > 0
    assert copy_step(source, same) == 0  # the same manifest: done


def _copy_with_one_share_corrupt(rank: int, world: int, root: str) -> tuple[str, str]:
    import torch
    import torch.distributed as dist

    source, target = Path(root) / "a" / "step-00000001", Path(root) / "b" / "step-00000001"
    ckpt.save({f"w{rank}": torch.arange(4096, dtype=torch.float32) + rank}, source)  # each rank its own file
    dist.barrier()
    if rank == 0:  # rank 1's share of the copy fails its check; rank 0's passes
        data = source / "data" / "rank-00001.bin"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    dist.barrier()
    try:
        copy_step(locate(source), locate(target), distributed=True)
    except ckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return "copied", ""


@pytest.mark.slow
def test_a_corrupt_share_on_one_rank_fails_the_copy_on_every_rank_without_a_hang(tmp_path):
    """The rank whose share failed its check raised before the commit's collective the other rank
    waited in (seen: the trainer's replicator hung at close, rank 0 in that broadcast, rank 1 in the
    next step's agreement); now every rank joins it, then both raise and nothing is committed."""
    from tests.support.launch import run_ranks

    results = run_ranks(2, _copy_with_one_share_corrupt, str(tmp_path), hang_seconds=20)
    assert [name for name, _ in results] == ["SourceCorruptError", "SourceCorruptError"], results
    assert "checksum mismatch" in results[1][1] and "failed verification on another rank" in results[0][1]
    assert CheckpointRoot(tmp_path / "b").committed() == []

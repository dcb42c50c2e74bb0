"""ckpt.commit.publish: outputs that are not checkpoints (a merged file, a sharded export) appear whole
or not at all, through the mount's commit strategy — on POSIX written under a temporary name and
renamed, on an object store (a real S3-protocol server on loopback) uploaded in place with an
overwrite's stale files removed — and the strategy is the storage's choice."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt
from ckpt import commit
from ckpt.storage import locate
from tests.support.s3server import bucket_objects


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_the_storage_chooses_the_strategy(s3_bucket):
    assert commit.strategy_for(locate("x").storage) is commit.RENAME
    assert isinstance(commit.RENAME, commit.RenameCommit)
    s3 = locate(f"{s3_bucket.url}/x", s3_bucket.storage_options).storage
    assert commit.strategy_for(s3) is commit.MANIFEST_LAST and isinstance(commit.MANIFEST_LAST, commit.ManifestLastCommit)


def test_a_pending_file_appears_only_when_published(tmp_path):
    target = tmp_path / "out" / "model.safetensors"
    pending = commit.PendingFile(locate(target), overwrite=False)
    pending.write(b"half")
    assert not target.exists() and len(_entries(tmp_path / "out")) == 1  # <name>.tmp-<id>
    pending.write(b" and the rest")
    pending.publish()
    assert target.read_bytes() == b"half and the rest" and _entries(tmp_path / "out") == ["model.safetensors"]
    with pytest.raises(ckpt.CheckpointExistsError, match="overwrite=True"):
        commit.PendingFile(locate(target), overwrite=False)
    with commit.PendingFile(locate(target), overwrite=True) as out:
        out.write(b"new")
    assert target.read_bytes() == b"new" and _entries(tmp_path / "out") == ["model.safetensors"]


def test_a_failed_pending_file_leaves_nothing_and_a_dead_ones_leftover_goes(tmp_path):
    target = tmp_path / "model.pt"
    with pytest.raises(RuntimeError, match="died"):
        with commit.PendingFile(locate(target), overwrite=False) as out:
            out.write(b"partial")
            raise RuntimeError("died")
    assert _entries(tmp_path) == []
    (tmp_path / "model.pt.tmp-0123456789ab").write_bytes(b"a dead write's")
    with commit.PendingFile(locate(target), overwrite=False) as out:
        out.write(b"whole")
    assert _entries(tmp_path) == ["model.pt"] and target.read_bytes() == b"whole"


def test_a_pending_directory_replaces_an_old_one_whole(tmp_path):
    target = tmp_path / "hf"
    with commit.PendingDirectory(locate(target), overwrite=False) as out:
        out.write_bytes("a.bin", b"a")
        handle = out.create("b.bin")
        handle.write(b"b")
        handle.close()
        assert not target.exists()
    assert _entries(target) == ["a.bin", "b.bin"]
    with pytest.raises(ckpt.CheckpointExistsError):
        commit.PendingDirectory(locate(target), overwrite=False)
    with commit.PendingDirectory(locate(target), overwrite=True) as out:
        out.write_bytes("c.bin", b"c")
        assert _entries(target) == ["a.bin", "b.bin"]  # the old one, whole, until the new one is in place
    assert _entries(target) == ["c.bin"] and _entries(tmp_path) == ["hf"]  # no .tmp-, no .old- left
    with pytest.raises(RuntimeError):
        with commit.PendingDirectory(locate(target), overwrite=True) as out:
            out.write_bytes("d.bin", b"d")
            raise RuntimeError("died")
    assert _entries(target) == ["c.bin"] and _entries(tmp_path) == ["hf"]


def test_a_pending_directory_on_an_object_store(s3_bucket):
    url, options = f"{s3_bucket.url}/hf", s3_bucket.storage_options
    with commit.PendingDirectory(locate(url, options), overwrite=False) as out:
        out.write_bytes("model-1.bin", b"1")
        out.write_bytes("model-2.bin", b"2")
        out.write_bytes("index.json", b"{}")  # the index last
    assert sorted(bucket_objects(s3_bucket, "hf")) == [f"{s3_bucket.name}/hf/{n}" for n in
                                                       ("index.json", "model-1.bin", "model-2.bin")]
    with pytest.raises(ckpt.CheckpointExistsError):
        commit.PendingDirectory(locate(url, options), overwrite=False)
    with commit.PendingDirectory(locate(url, options), overwrite=True) as out:  # fewer shards now
        out.write_bytes("model-1.bin", b"one")
        out.write_bytes("index.json", b"{ }")
    assert bucket_objects(s3_bucket, "hf") == {f"{s3_bucket.name}/hf/index.json": b"{ }",
                                               f"{s3_bucket.name}/hf/model-1.bin": b"one"}
    with pytest.raises(RuntimeError):
        with commit.PendingDirectory(locate(url, options), overwrite=True) as out:
            out.write_bytes("extra.bin", b"x")
            raise RuntimeError("died")
    assert sorted(bucket_objects(s3_bucket, "hf")) == [f"{s3_bucket.name}/hf/index.json", f"{s3_bucket.name}/hf/model-1.bin"]


def test_attempting_aborts_a_checkpoint_that_failed(tmp_path):
    target = tmp_path / "step-00000001"
    with pytest.raises(RuntimeError):
        with commit.attempting(locate(target), overwrite=False) as attempt:
            (Path(attempt.directory.path) / "data" / "rank-00000.bin").write_bytes(b"x")
            raise RuntimeError("died")
    assert _entries(tmp_path) == []

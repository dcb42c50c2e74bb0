"""Reading a checkpoint verifies every byte: damaged data files fail loudly, naming the tensor and the
file, a symlink out of the checkpoint is refused, a missing checkpoint is not found, and a refused
load touches nothing.

Single process, small states of plain tensors. Every test builds its damage by hand from what the
manifest says (chunk offsets, file names), so it fails if the engine stops detecting that damage.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import ckpt
from ckpt.read.source import verify_blobs
from ckpt.storage import locate
from tests.support.checkpoints import (
    BIAS,
    DATA_FILE,
    WEIGHT,
    assert_refused,
    assert_state_equal,
    assert_untouched,
    blank_state,
    file_fingerprint,
)


# -- the baseline all damage is measured against --------------------------------------------------

def test_round_trip_is_bitwise(saved):
    path, state = saved
    live = blank_state()
    ckpt.load(live, path)
    assert_state_equal(live, state)


# -- a flipped byte names the tensor and the file -------------------------------------------------

@pytest.mark.parametrize("victim", [WEIGHT, BIAS])
def test_flipped_byte_names_tensor_and_file(saved, victim):
    path, _ = saved
    blob = ckpt.read_manifest(path).tensors[victim].chunks[0].blob
    assert blob.file == DATA_FILE
    data_path = path / blob.file
    raw = bytearray(data_path.read_bytes())
    raw[blob.offset + blob.length // 2] ^= 0x5A
    data_path.write_bytes(raw)

    with pytest.raises(ckpt.CorruptCheckpointError) as info:
        ckpt.load(blank_state(), path)
    err = info.value
    assert type(err) is ckpt.CorruptCheckpointError
    assert err.tensor == victim
    assert victim in str(err)
    other = BIAS if victim == WEIGHT else WEIGHT
    assert other not in str(err)
    assert err.file is not None and Path(err.file).as_posix().endswith(DATA_FILE)
    assert DATA_FILE in str(err)


# -- truncated / missing data file ----------------------------------------------------------------

def test_truncated_data_file(saved):
    path, _ = saved
    manifest = ckpt.read_manifest(path)
    end = max(c.blob.offset + c.blob.length for e in manifest.tensors.values() for c in e.chunks)
    data_path = path / DATA_FILE
    assert data_path.stat().st_size >= end
    os.truncate(data_path, end - 100)  # the last chunk loses its tail

    with pytest.raises(ckpt.CorruptCheckpointError) as info:
        ckpt.load(blank_state(), path)
    assert "truncat" in str(info.value).lower()
    assert info.value.file is not None and Path(info.value.file).as_posix().endswith(DATA_FILE)


def test_a_chunk_beyond_its_file_is_refused_before_any_live_tensor_is_written(saved):
    """The file sizes are checked for every chunk to be read before the first byte is copied into
    the live state (the check used to happen chunk by chunk, after earlier chunks were written)."""
    path, _ = saved
    manifest = ckpt.read_manifest(path)
    blobs = sorted((c.blob for e in manifest.tensors.values() for c in e.chunks), key=lambda b: b.offset)
    os.truncate(path / DATA_FILE, blobs[-1].offset + 1)  # only the last chunk is cut
    live = blank_state()
    with pytest.raises(ckpt.CorruptCheckpointError, match="truncated"):
        ckpt.load(live, path)
    assert_untouched(live)


def test_missing_data_file(saved):
    path, _ = saved
    (path / DATA_FILE).unlink()
    with pytest.raises(ckpt.CorruptCheckpointError) as info:
        ckpt.load(blank_state(), path)
    assert "rank-00000.bin" in str(info.value)
    assert info.value.file is not None and Path(info.value.file).as_posix().endswith(DATA_FILE)


# -- a whole checkpoint verified (ckpt-inspect --verify, a replica's read-back) -------------------

def test_verify_blobs_reads_every_blob_and_raises_or_reports_each_failure(saved):
    path, _ = saved
    location, manifest = locate(path), ckpt.read_manifest(path)
    assert [key for key, _blob in manifest.blobs()] == sorted([WEIGHT, BIAS])  # every tensor chunk, by key
    read = []
    verify_blobs(location, manifest, progress=read.append)
    assert sum(read) == sum(blob.length for _key, blob in manifest.blobs()) > 0
    blob = manifest.tensors[WEIGHT].chunks[0].blob
    raw = bytearray((path / blob.file).read_bytes())
    raw[blob.offset + blob.length // 2] ^= 0x5A
    (path / blob.file).write_bytes(raw)

    failures = []
    verify_blobs(location, manifest, failed=lambda key, blob, exc: failures.append((key, blob.file, type(exc))))
    assert failures == [(WEIGHT, DATA_FILE, ckpt.CorruptCheckpointError)]
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        verify_blobs(location, manifest)
    assert (info.value.file, info.value.tensor) == (DATA_FILE, WEIGHT)
    verify_blobs(location, manifest, files=["data/rank-00001.bin"])  # only the files named: none of these


# -- no checkpoint at all -------------------------------------------------------------------------

def test_missing_manifest_is_not_found(saved):
    path, _ = saved
    (path / "manifest.json").unlink()
    assert_refused(path, ckpt.CheckpointNotFoundError)


def test_nonexistent_path_is_not_found(run_dir):
    live = blank_state()
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(live, run_dir / "no-such-step")
    assert_untouched(live)
    assert not (run_dir / "no-such-step").exists()


# -- a symlink out of the checkpoint --------------------------------------------------------------

@pytest.mark.parametrize("what", ["file", "data-dir"])
def test_symlink_out_of_checkpoint_is_refused(saved, what):
    path, _ = saved
    outside = path.parent.parent / "outside"
    outside.mkdir()
    real = path / DATA_FILE
    # different bytes of the same length: followed, they would land in the live tensors
    sentinel_bytes = bytes(b ^ 0xFF for b in real.read_bytes())
    sentinel = outside / "rank-00000.bin"
    sentinel.write_bytes(sentinel_bytes)
    before = file_fingerprint(sentinel)
    if what == "file":
        real.unlink()
        real.symlink_to(sentinel)
    else:
        shutil.rmtree(path / "data")
        (path / "data").symlink_to(outside, target_is_directory=True)

    live = blank_state()
    with pytest.raises(ckpt.InvalidManifestError) as info:
        ckpt.load(live, path)
    assert "rank-00000.bin" in str(info.value)
    assert_untouched(live)
    assert file_fingerprint(sentinel) == before


def test_a_manifest_that_is_a_symlink_is_not_followed(saved):
    """A manifest.json linking out of the checkpoint is refused, even when the file it points to is
    a perfectly valid manifest (here: the checkpoint's own, moved outside)."""
    path, _ = saved
    outside = path.parent.parent / "elsewhere.json"
    (path / "manifest.json").rename(outside)
    (path / "manifest.json").symlink_to(outside)
    assert_refused(path, ckpt.InvalidManifestError)


def test_errors_name_the_checkpoint_file_and_tensor_plainly(saved):
    path, _ = saved
    (path / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointNotFoundError) as info:
        ckpt.load(blank_state(), path)
    assert (info.value.file, info.value.path) == ("manifest.json", str(path))


def test_plain_dcp_load_gets_our_error_class(saved, run_dir):
    """Through dcp.load our errors arrive inside DCP's CheckpointException as themselves (a failed
    metadata read used to surface as DCP's AssertionError carrying only the text)."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    for where, expected in ((run_dir / "no-such-step", ckpt.CheckpointNotFoundError),):
        with pytest.raises(CheckpointException) as info:
            dcp_load(blank_state(), storage_reader=ckpt.dcp.Reader(where))
        failures = [pair[0] for pair in info.value.failures.values()]
        assert [type(f) for f in failures] == [expected], failures

"""Damaged, hostile and incompatible checkpoints fail loudly, with the right error, and touch nothing.

Single process, small states of plain tensors. Every test builds its damage by hand from what the
manifest says (chunk offsets, file names), so it fails if the engine stops detecting that damage.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
from ckpt import commit

DATA_FILE = "data/rank-00000.bin"
WEIGHT, BIAS = "encoder.weight", "encoder.bias"


# -- helpers ------------------------------------------------------------------------------------

def make_state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        WEIGHT: torch.randn(64, 64, generator=gen),
        BIAS: torch.randn(300, generator=gen),
        "step": 3 + seed,
    }


def blank_state() -> dict:
    """A live state of the right layout whose contents differ from any saved one."""
    return {WEIGHT: torch.full((64, 64), 7.0), BIAS: torch.full((300,), 7.0), "step": -1}


def assert_state_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype and actual[key].shape == value.shape, key
            # bitwise: compare the raw bytes, not float values (NaN-safe, -0.0-safe)
            assert torch.equal(actual[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert actual[key] == value, key


def assert_untouched(live: dict) -> None:
    assert_state_equal(live, blank_state())

def assert_refused(path, error) -> None:
    """Both reading the manifest and loading fail with ``error``, and the live state is untouched."""
    with pytest.raises(error):
        ckpt.read_manifest(path)
    live = blank_state()
    with pytest.raises(error):
        ckpt.load(live, path)
    assert_untouched(live)



def save_fresh(path: Path, seed: int = 0) -> dict:
    state = make_state(seed)
    ckpt.save(state, path)
    return state


def edit_manifest(path: Path, mutate) -> None:
    manifest = path / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    mutate(doc)
    manifest.write_text(json.dumps(doc))


def chunk_doc(doc: dict, key: str = WEIGHT) -> dict:
    return doc["tensors"][key]["chunks"][0]


def file_fingerprint(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Checkpoints live in ``tmp_path/run``; hostile names aim at files in ``tmp_path`` and ``run``."""
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture
def saved(run_dir: Path) -> tuple[Path, dict]:
    path = run_dir / "step-1"
    return path, save_fresh(path)


# -- 0. the baseline all damage is measured against ---------------------------------------------

def test_round_trip_is_bitwise(saved):
    path, state = saved
    live = blank_state()
    ckpt.load(live, path)
    assert_state_equal(live, state)


# -- 1. a flipped byte names the tensor and the file --------------------------------------------

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


# -- 2. truncated / missing data file ----------------------------------------------------------

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


def test_missing_data_file(saved):
    path, _ = saved
    (path / DATA_FILE).unlink()
    with pytest.raises(ckpt.CorruptCheckpointError) as info:
        ckpt.load(blank_state(), path)
    assert "rank-00000.bin" in str(info.value)
    assert info.value.file is not None and Path(info.value.file).as_posix().endswith(DATA_FILE)


# -- 3. no checkpoint at all --------------------------------------------------------------------

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


# -- 4. hostile manifests -----------------------------------------------------------------------

def _set_file(name):
    return lambda doc: chunk_doc(doc).update(file=name)


HOSTILE_NAMES = {
    "parent-escape": "../../outside.bin",   # -> tmp_path/outside.bin
    "absolute": "/etc/passwd",
    "dotdot-inside-data": "data/../../x.bin",  # -> tmp_path/run/x.bin
}


@pytest.mark.parametrize("case", sorted(HOSTILE_NAMES))
def test_hostile_file_name_is_refused(saved, case):
    path, _ = saved
    run_dir = path.parent
    real_bytes = (path / DATA_FILE).read_bytes()
    # Sentinels where the hostile names point hold the genuine bytes: a reader that followed the
    # name would verify the checksums and load successfully instead of refusing.
    sentinels = [run_dir.parent / "outside.bin", run_dir / "x.bin"]
    for sentinel in sentinels:
        sentinel.write_bytes(real_bytes)
    before = [file_fingerprint(s) for s in sentinels]
    edit_manifest(path, _set_file(HOSTILE_NAMES[case]))

    assert_refused(path, ckpt.InvalidManifestError)
    assert [file_fingerprint(s) for s in sentinels] == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-1", "x.bin"]


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


def _absurd_shape(doc):
    doc["tensors"][WEIGHT]["shape"] = [2**40, 2**40]
    chunk_doc(doc).update(sizes=[2**40, 2**40])


def _length_not_box(doc):
    chunk_doc(doc)["length"] += 4


def _chunk_outside_shape(doc):
    chunk_doc(doc)["offsets"] = [32, 0]  # a 64x64 box at row 32 of a 64x64 tensor


def _negative_offset(doc):
    chunk_doc(doc)["offset"] = -4096


def _bad_checksum_text(doc):
    chunk_doc(doc)["checksum"] = "../../etc/passwd"


HOSTILE_DOCS = {
    "absurd-shape": _absurd_shape,
    "length-not-box": _length_not_box,
    "chunk-outside-shape": _chunk_outside_shape,
    "negative-offset": _negative_offset,
    "malformed-checksum": _bad_checksum_text,
}


@pytest.mark.parametrize("case", sorted(HOSTILE_DOCS))
def test_hostile_manifest_values_are_refused(saved, case):
    path, _ = saved
    edit_manifest(path, HOSTILE_DOCS[case])
    assert_refused(path, ckpt.InvalidManifestError)


@pytest.mark.parametrize("content", [b"\x00\xffnot json at all{", b'{"format": "ckpt", "format_ver'],
                         ids=["garbage", "torn-write"])
def test_manifest_that_is_not_json(saved, content):
    path, _ = saved
    (path / "manifest.json").write_bytes(content)
    assert issubclass(ckpt.InvalidManifestError, ckpt.CorruptCheckpointError)
    assert_refused(path, ckpt.InvalidManifestError)


def test_newer_format_version_is_unsupported(saved):
    path, _ = saved
    edit_manifest(path, lambda doc: doc.update(format_version=999))
    with pytest.raises(ckpt.UnsupportedFormatError):
        ckpt.read_manifest(path)
    live = blank_state()
    with pytest.raises(ckpt.UnsupportedFormatError) as info:
        ckpt.load(live, path)
    assert "999" in str(info.value)
    assert_untouched(live)


# -- 5. non-JSON values: torch.save streams, never code execution ------------------------------

class Booby:
    """Pickles as ``open(marker, "w")``: unpickling it with weights_only=False creates the marker."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_set_value_is_torch_save_and_round_trips(run_dir):
    path = run_dir / "step-1"
    state = {WEIGHT: torch.randn(8, 8), "seen": {3, 1, 4, 15, 9}}
    ckpt.save(state, path)
    doc = json.loads((path / "manifest.json").read_bytes())
    assert doc["values"]["seen"]["encoding"] == "torch_save"
    assert ckpt.read_manifest(path).values["seen"].encoding == "torch_save"

    live = {WEIGHT: torch.zeros(8, 8), "seen": None}
    ckpt.load(live, path)
    assert live["seen"] == {3, 1, 4, 15, 9}
    assert torch.equal(live[WEIGHT], state[WEIGHT])

    # plain DCP (DefaultLoadPlanner, torch.load(weights_only=False)) gets a safe re-serialised copy
    flat = {WEIGHT: torch.zeros(8, 8), "seen": None}
    dcp.load(flat, storage_reader=ckpt.dcp.Reader(path))
    assert flat["seen"] == {3, 1, 4, 15, 9}
    assert torch.equal(flat[WEIGHT], state[WEIGHT])


def test_code_in_a_value_never_runs(run_dir, tmp_path):
    marker = tmp_path / "pwned"
    path = run_dir / "step-1"
    ckpt.save({WEIGHT: torch.randn(8, 8), "hook": Booby(marker)}, path)
    assert not marker.exists()
    entry = ckpt.read_manifest(path).values["hook"]
    assert entry.encoding == "torch_save"

    live = {WEIGHT: torch.zeros(8, 8), "hook": None}
    with pytest.raises(ckpt.UnsafeCheckpointError) as info:
        ckpt.load(live, path)
    assert "hook" in str(info.value)
    assert not marker.exists()
    assert live["hook"] is None

    # Plain DCP with its DefaultLoadPlanner would torch.load(weights_only=False) whatever stream the
    # reader hands over; our reader must refuse first.
    flat = {WEIGHT: torch.zeros(8, 8), "hook": None}
    with pytest.raises((ckpt.UnsafeCheckpointError, CheckpointException)) as info:
        dcp.load(flat, storage_reader=ckpt.dcp.Reader(path))
    if isinstance(info.value, CheckpointException):
        failures = [pair[0] for pair in info.value.failures.values()]
        assert any(isinstance(f, ckpt.UnsafeCheckpointError) for f in failures), failures
    assert not marker.exists()
    assert flat["hook"] is None

    # The payload is armed: unpickling the stored bytes unsafely does create the marker.
    raw = (path / entry.blob.file).read_bytes()[entry.blob.offset : entry.blob.offset + entry.blob.length]
    handle = torch.load(io.BytesIO(raw), weights_only=False)
    handle.close()
    assert marker.exists()


# -- 6. incompatible state: one error listing everything ---------------------------------------

def test_incompatible_state_lists_every_problem(saved):
    path, _ = saved
    live = {
        WEIGHT: torch.full((64, 32), 7.0),                       # shape mismatch
        BIAS: torch.full((300,), 7.0, dtype=torch.float64),      # dtype mismatch
        "head.weight": torch.full((4,), 7.0),                    # missing from the checkpoint
        # "step" left out: unexpected in the checkpoint
    }
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(ckpt.IncompatibleCheckpointError) as info:
        ckpt.load(live, path)
    err = info.value
    assert err.missing == ["head.weight"]
    assert err.unexpected == ["step"]
    mismatched = {key: (saved_desc, live_desc) for key, saved_desc, live_desc in err.mismatched}
    assert sorted(mismatched) == [BIAS, WEIGHT]
    assert "64, 64" in mismatched[WEIGHT][0] and "64, 32" in mismatched[WEIGHT][1]
    assert "float32" in mismatched[BIAS][0] and "float64" in mismatched[BIAS][1]
    message = str(err)
    for needle in ("head.weight", "step", WEIGHT, BIAS, "64, 32", "float64"):
        assert needle in message, needle
    for key, value in before.items():  # checked before a single byte is read
        assert torch.equal(live[key], value)

    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is ckpt.IncompatibleCheckpointError
    assert (clone.missing, clone.unexpected, clone.mismatched) == (err.missing, err.unexpected, err.mismatched)
    assert str(clone) == str(err)


def test_non_strict_tolerates_missing_and_unexpected_keys(saved):
    path, state = saved
    live = {WEIGHT: torch.full((64, 64), 7.0), "head.weight": torch.full((4,), 7.0)}
    ckpt.load(live, path, strict=False)
    assert torch.equal(live[WEIGHT], state[WEIGHT])
    assert torch.equal(live["head.weight"], torch.full((4,), 7.0))
    assert set(live) == {WEIGHT, "head.weight"}


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_non_strict_still_refuses_shape_and_dtype(saved, bad):
    path, _ = saved
    wrong = torch.full((64, 32), 7.0) if bad == "shape" else torch.full((64, 64), 7.0, dtype=torch.bfloat16)
    live = {WEIGHT: wrong, "head.weight": torch.zeros(4)}
    before = wrong.clone()
    with pytest.raises(ckpt.IncompatibleCheckpointError) as info:
        ckpt.load(live, path, strict=False)
    assert [m[0] for m in info.value.mismatched] == [WEIGHT]
    assert info.value.missing == [] and info.value.unexpected == []
    assert torch.equal(live[WEIGHT], before)


# -- 7. overwrite ------------------------------------------------------------------------------

def _snapshot_tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_save_onto_committed_checkpoint(saved):
    path, old_state = saved
    before = _snapshot_tree(path)
    new_state = make_state(seed=1)

    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save(new_state, path)
    assert _snapshot_tree(path) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-1"]
    live = blank_state()
    ckpt.load(live, path)
    assert_state_equal(live, old_state)

    ckpt.save(new_state, path, overwrite=True)
    live = blank_state()
    ckpt.load(live, path)
    assert_state_equal(live, new_state)
    assert sorted(p.name for p in path.parent.iterdir()) == ["step-1"]


# -- 8. commit-protocol leftovers --------------------------------------------------------------

def test_stale_tmp_dir_is_never_the_checkpoint(run_dir):
    target = run_dir / "step-5"
    # a complete-looking save that died just before its rename: it even has a manifest
    stale = run_dir / f"step-5{commit.TMP_MARK}0123456789ab"
    save_fresh(run_dir / "scratch", seed=2)
    os.rename(run_dir / "scratch", stale)
    assert (stale / "manifest.json").is_file()
    assert not commit.is_committed(stale)

    live = blank_state()
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(live, target)
    assert_untouched(live)

    state = save_fresh(target, seed=3)
    assert not stale.exists()
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-5"]
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, state)


def _crash_between_renames(run_dir: Path) -> tuple[Path, dict]:
    """Leave what an overwrite of ``step-7`` leaves when it dies after moving the old copy aside."""
    target = run_dir / "step-7"
    old_state = save_fresh(target, seed=4)
    os.rename(target, run_dir / f"step-7{commit.OLD_MARK}feedfacecafe")
    save_fresh(run_dir / "scratch", seed=5)  # the new copy, complete but never renamed
    os.rename(run_dir / "scratch", run_dir / f"step-7{commit.TMP_MARK}feedfacecafe")
    return target, old_state


def test_collect_garbage_restores_moved_aside_copy(run_dir):
    target, old_state = _crash_between_renames(run_dir)
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(blank_state(), target)

    commit.collect_garbage(target)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-7"]
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, old_state)


def test_next_save_restores_moved_aside_copy(run_dir):
    target, old_state = _crash_between_renames(run_dir)
    with pytest.raises(ckpt.CheckpointExistsError):  # the old copy is back, so it is not replaced
        ckpt.save(make_state(seed=6), target)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-7"]
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, old_state)


def test_leftover_old_copy_beside_committed_target_is_deleted(run_dir):
    target = run_dir / "step-8"
    save_fresh(target, seed=7)
    shutil.copytree(target, run_dir / f"step-8{commit.OLD_MARK}0badc0ffee00")  # died before rmtree
    new_state = make_state(seed=8)
    ckpt.save(new_state, target, overwrite=True)
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-8"]
    live = blank_state()
    ckpt.load(live, target)
    assert_state_equal(live, new_state)

"""ckpt.format.manifest (parsed through ckpt.format.validate): a hostile or unreadable manifest is
refused before a single data byte is read (file names outside the checkpoint, absurd or inconsistent
values, not JSON, a newer format version), and the refused load touches nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.format import Blob, Chunk, Manifest, TensorEntry, ValueEntry, seal
from tests.support.checkpoints import DATA_FILE, WEIGHT, assert_refused, assert_untouched, blank_state, file_fingerprint


def edit_manifest(path: Path, mutate, *, reseal: bool = True) -> None:
    """Change the manifest's document. A hostile author reseals it (the digest guards against
    damage, not against someone who rewrites the file on purpose); damage does not."""
    manifest = path / "manifest.json"
    doc = json.loads(manifest.read_bytes())
    doc.pop("digest", None)
    mutate(doc)
    manifest.write_bytes(seal(doc) if reseal else json.dumps(doc, separators=(",", ":")).encode())


def chunk_doc(doc: dict, key: str = WEIGHT) -> dict:
    return doc["tensors"][key]["chunks"][0]


# -- hostile manifests ----------------------------------------------------------------------------

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


# -- unreadable and newer manifests ---------------------------------------------------------------

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


# -- what a manifest lists ------------------------------------------------------------------------

def test_a_manifest_lists_every_blob_once_tensors_then_values_by_key():
    def blob(name, offset):
        return Blob(f"data/{name}.bin", offset, 4, "0" * 16)

    z0, z1, a0, v = blob("rank-00000", 0), blob("rank-00001", 0), blob("rank-00000", 4096), blob("rank-00000", 8)
    manifest = Manifest(
        tensors={"z": TensorEntry(torch.float32, (2,), [Chunk((0,), (1,), z0), Chunk((1,), (1,), z1)]),
                 "a": TensorEntry(torch.float32, (1,), [Chunk((0,), (1,), a0)])},
        values={"v": ValueEntry("torch_save", blob=v), "j": ValueEntry("json", value=1)},
    )
    assert list(manifest.blobs()) == [("a", a0), ("z", z0), ("z", z1), ("v", v)]
    assert manifest.data_files() == {"data/rank-00000.bin", "data/rank-00001.bin"}

"""A data file checked while its bytes arrive (ckpt/memory/arrival.py), the partner copy's receiver's
check in place of reading the file back: a real rank checkpoint (a version-3 blob of several blocks,
small blobs, a value) passes in pieces of any size, as verify_blobs passes it; a flipped byte in any
blob or block table is refused naming its key; a wrong size, a blob beyond the file, bytes beyond
the end or a file that ends early are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.memory.arrival import ArrivingFile, blobs_of
from ckpt.memory.local import flat_local, write_local
from ckpt.read import verify_blobs
from ckpt.storage import locate


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(manifest, {data file: its bytes}) of a rank checkpoint as the memory tier writes it."""
    where = tmp_path_factory.mktemp("arrival") / "rank"
    state = {"big": torch.arange(3 * (1 << 18), dtype=torch.float32), "small": torch.ones(10),
             "tiny": torch.zeros(3, dtype=torch.int8), "step": 3, "extra": {"note": "x" * 100}}
    manifest, _ = write_local(*flat_local(state), locate(where), step=3, run=None, user={})
    verify_blobs(locate(where), manifest)
    files = {name: (Path(where) / name).read_bytes() for name in manifest.data_files()}
    assert any(blob.block_table is not None for _, blob in manifest.blobs())  # blocks are covered
    return manifest, files


def _arrive(manifest, name: str, data: bytes, piece: int, size: int | None = None) -> None:
    check = ArrivingFile(name, len(data) if size is None else size, blobs_of(manifest)[name],
                         expected_size=manifest.files.get(name))
    for at in range(0, len(data), piece):
        check.update(data[at: at + piece])
    check.finish()


@pytest.mark.parametrize("piece", [1000, 4096, (1 << 20) + 7, 1 << 30])
def test_a_whole_file_passes_in_pieces_of_any_size(written, piece):
    manifest, files = written
    for name, data in files.items():
        _arrive(manifest, name, data, piece)


def test_a_flipped_byte_in_any_blob_or_block_table_is_refused_naming_it(written):
    manifest, files = written
    places = []
    for key, blob in manifest.blobs():
        if blob.length:
            places.append((key, blob.file, blob.offset + blob.length // 2, "checksum mismatch"))
        if blob.block_table is not None:
            places.append((key, blob.file, blob.block_table + 3, "block table"))
    assert any(why == "block table" for *_, why in places)
    for key, name, at, why in places:
        damaged = bytearray(files[name])
        damaged[at] ^= 0x01
        with pytest.raises(ckpt.CorruptCheckpointError, match=why) as caught:
            _arrive(manifest, name, bytes(damaged), 4096)
        assert caught.value.tensor == key and caught.value.file == name


def test_sizes_and_bounds_are_refused(written):
    manifest, files = written
    name, data = next(iter(files.items()))
    with pytest.raises(ckpt.CorruptCheckpointError, match="its manifest says"):  # before any byte
        ArrivingFile(name, len(data) + 1, blobs_of(manifest)[name], expected_size=len(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match="truncated"):  # a blob beyond the file
        ArrivingFile(name, len(data) // 2, blobs_of(manifest)[name])
    with pytest.raises(ckpt.CorruptCheckpointError, match="ended at byte"):
        _arrive(manifest, name, data[:-1], 4096, size=len(data))
    with pytest.raises(ckpt.CorruptCheckpointError, match="runs past"):
        _arrive(manifest, name, data + b"\0", 4096, size=len(data))

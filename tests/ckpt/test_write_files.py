"""A data file as ckpt/write/files.py's ``write_file`` lays it out: small blobs (below the 64 KiB
alignment threshold) hashed inline and gathered into few writes, large ones 4 KiB-aligned and
hashed on the helper thread, block tables after the last blob; every blob lands where one write per
blob would have put it, its bytes and checksum as recorded."""

from __future__ import annotations

import numpy as np

from ckpt.format.blobs import aligned
from ckpt.format.blocks import BLOCK_SIZE, hash_blob
from ckpt.storage import locate
from ckpt.storage.local import LocalWriter
from ckpt.write import Payload
from ckpt.write import files as write_files

# small ones around a large one, enough small ones after it to pass one gathered write, one with blocks
SIZES = [4, 100, 70_000, 8, 3000, *[30_000] * 40, 12, 2 * BLOCK_SIZE + 5, 1]


def _payloads() -> list[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(i, rng.integers(0, 256, n, dtype=np.uint8)) for i, n in enumerate(SIZES)]


def test_blobs_land_where_one_write_each_put_them_small_ones_gathered(tmp_path, monkeypatch):
    writes = []
    real_write = LocalWriter.write
    monkeypatch.setattr(LocalWriter, "write", lambda self, data: (writes.append(len(data)), real_write(self, data))[1])
    (tmp_path / "data").mkdir()
    data = _payloads()
    placed = dict(write_files.write_file(locate(tmp_path), "data/rank-00000.bin",
                                         [Payload(key, lambda a=a: a, len(a)) for key, a in data]))
    stored = (tmp_path / "data/rank-00000.bin").read_bytes()
    end = 0
    for key, array in data:
        blob = placed[key]
        start = aligned(end, len(array))
        assert (blob.offset, blob.length) == (start, len(array))
        assert stored[start: start + len(array)] == array.tobytes()
        checksum, table = hash_blob(array, BLOCK_SIZE)
        assert blob.checksum == checksum
        if table is not None:
            assert stored[blob.block_table: blob.block_table + len(table)] == table
        end = start + len(array)
    small = sum(n < write_files.SMALL_BLOB_BYTES for n in SIZES)
    assert len(writes) < len(SIZES) - small + 8  # not one write per small blob
    assert max(writes) >= write_files.SMALL_WRITE_BYTES  # a gathered write flushed on its size

"""Partial reads straight into the live tensor (:mod:`ckpt.read.scatter`): a resharded load whose box
is whole rows, or rows of long runs, reads the blocks it needs with scatter reads into the target
itself (what no want needs into scratch), each block still verified; nothing else of the live
tensor is touched; short runs, strided rows and overlapping boxes are staged and copied instead, each staged window's
blocks checked against the block table before a byte of it is copied out.

Single process: the boxes another layout's rank would want are driven through
:func:`ckpt.read.prefetch.read_chunks` (the multi-rank reshards are tests/ckpt/test_reshard.py).
"""

from __future__ import annotations

import os

import pytest
import torch

import ckpt
from ckpt.read import prefetch, scatter
from ckpt.format.blocks import BLOCK_SIZE
from ckpt.read.prefetch import Want, read_chunks
from ckpt.read.source import ChunkSource
from ckpt.storage import locate
from ckpt.storage import _posix_io
from ckpt.storage.base import read_scatter

WIDE = 65536  # fp32 columns: 256 KiB rows, a half row is a run worth reading in place


@pytest.fixture
def no_staging(monkeypatch):
    """Fails a read that stages a window and copies out of it."""
    def staged(*args, **kwargs):
        raise AssertionError("window staged")
    monkeypatch.setattr(prefetch, "_Window", staged)


def _save(tmp_path, tensor):
    path = tmp_path / "ckpt"
    ckpt.save({"w": tensor}, path)
    return path


def _read(path, wants_spec, *, window=None, monkeypatch=None):
    """Drive ``read_chunks`` with ``(offsets, lengths, target)`` boxes of ``w``'s one chunk."""
    if window is not None:
        monkeypatch.setattr(prefetch, "WINDOW_BYTES", window)
    manifest = ckpt.read_manifest(path)
    chunk = manifest.tensors["w"].chunks[0]
    done = []
    wants = [Want(tuple(o), tuple(n), lambda t=t: t, done.append) for o, n, t in wants_spec]
    with ChunkSource(locate(path), manifest) as source:
        source.files.check(chunk.blob, what="w")
        read_chunks(source, [("w", chunk, wants, None)])
    assert len(done) == len(wants)


def _flip(path, at: int) -> None:
    """Flip one bit of ``w``'s stored byte ``at`` (in its one chunk)."""
    blob = ckpt.read_manifest(path).tensors["w"].chunks[0].blob
    data = path / blob.file
    raw = bytearray(data.read_bytes())
    raw[blob.offset + at] ^= 0x01
    data.write_bytes(raw)


def _bits(t):
    return t.view(torch.int32)


def test_whole_rows_are_read_in_place_and_only_their_blocks(tmp_path, no_staging, monkeypatch):
    state = torch.randn(1000, 1024)  # 4 KiB rows, 4 blocks
    path = _save(tmp_path, state)
    out = torch.full((250, 1024), -1.0)
    _read(path, [((300, 0), (250, 1024), out)], window=100 * 4096, monkeypatch=monkeypatch)
    assert torch.equal(_bits(out), _bits(state[300:550]))


def test_long_runs_of_a_column_box_land_in_the_target_and_nothing_else_changes(tmp_path, no_staging):
    state = torch.randn(24, WIDE)  # 6 MiB, 6 blocks; a quarter row is 64 KiB
    path = _save(tmp_path, state)
    live = torch.full((24, 2 * WIDE), -1.0)  # the target is a strided view: half of each live row
    target = live[:, WIDE:]
    _read(path, [((0, 0), (24, WIDE), target)])  # FSDP×TP → FSDP: a whole chunk into a column box
    assert torch.equal(_bits(target), _bits(state))
    assert torch.equal(live[:, :WIDE], torch.full((24, WIDE), -1.0))
    half = torch.full((24, WIDE // 2), -1.0)
    _read(path, [((0, WIDE // 4), (24, WIDE // 2), half)])  # Shard(0) → Shard(1): half of each row
    assert torch.equal(_bits(half), _bits(state[:, WIDE // 4: 3 * WIDE // 4]))


def test_whole_short_rows_land_in_a_strided_target_across_block_boundaries(tmp_path, no_staging, monkeypatch):
    # FSDP×TP → FSDP with a small hidden size: each stored row (12 KiB: rows straddle the 1 MiB
    # blocks) is one run of a strided target; every buffer of a piece stays inside one block
    state = torch.randn(700, 3072)
    path = _save(tmp_path, state)
    live = torch.full((700, 2 * 3072), -1.0)
    _read(path, [((0, 0), (700, 3072), live[:, 3072:])], window=300 * 12288, monkeypatch=monkeypatch)
    assert torch.equal(_bits(live[:, 3072:]), _bits(state))
    assert torch.equal(live[:, :3072], torch.full((700, 3072), -1.0))


def test_a_damaged_block_fails_short_rows_read_into_a_strided_target(tmp_path, no_staging):
    path = _save(tmp_path, torch.randn(700, 3072))  # 12 KiB rows, straddling blocks
    _flip(path, 5 * BLOCK_SIZE + 12345)
    live = torch.zeros(700, 2 * 3072)
    with pytest.raises(ckpt.CorruptCheckpointError, match="block 5"):
        _read(path, [((0, 0), (700, 3072), live[:, :3072])])


def test_piece_buffers_tile_the_piece_and_start_each_block():
    memory = memoryview(bytearray(64 << 20))
    maps = [scatter.RowMap(0, 1000, 0, 12288, 0, 12288, memory, 0, 2 * 12288)]  # rows into every other slot
    scratch = memoryview(bytearray(4 << 20))
    start, stop = 2 << 20, (4 << 20) + 5000
    buffers, starts = scatter.piece_buffers(maps, scratch, start, start, stop, BLOCK_SIZE)
    assert sum(len(b) for b in buffers) == stop - start
    ends = [start]
    for b in buffers:
        ends.append(ends[-1] + len(b))
    assert [ends[i] for i in starts] == [2 << 20, 3 << 20, 4 << 20]  # one group per block
    assert all(e0 // BLOCK_SIZE == (e1 - 1) // BLOCK_SIZE for e0, e1 in zip(ends, ends[1:]))


def test_two_boxes_of_one_chunk_and_a_one_dimensional_chunk(tmp_path, no_staging):
    state = torch.randn(40, WIDE // 4)
    path = _save(tmp_path, state)
    a, b = torch.empty(5, WIDE // 4), torch.empty(12, WIDE // 4)
    _read(path, [((30, 0), (5, WIDE // 4), a), ((3, 0), (12, WIDE // 4), b)])
    assert torch.equal(_bits(a), _bits(state[30:35])) and torch.equal(_bits(b), _bits(state[3:15]))
    flat = torch.randn(700_000)
    path = _save(tmp_path / "flat", flat)
    part = torch.empty(400_000)
    _read(path, [((100_000,), (400_000,), part)])
    assert torch.equal(_bits(part), _bits(flat[100_000:500_000]))


def test_a_damaged_block_fails_a_read_in_place(tmp_path, no_staging):
    state = torch.randn(24, WIDE)
    path = _save(tmp_path, state)
    _flip(path, 4 * BLOCK_SIZE + 77)
    with pytest.raises(ckpt.CorruptCheckpointError, match="block 4"):
        _read(path, [((16, 0), (8, WIDE), torch.empty(8, WIDE))])
    rows = torch.empty(8, WIDE)
    _read(path, [((0, 0), (8, WIDE), rows)])  # blocks 0-1: not this read's damage
    assert torch.equal(_bits(rows), _bits(state[:8]))


def test_short_runs_strided_rows_and_overlaps_are_staged_instead(tmp_path):
    sizes = (100, 1024)

    def want(offsets, lengths, target):
        return Want(offsets, lengths, lambda: target, lambda t: None)

    short = want((0, 512), (100, 512), torch.empty(100, 512))  # 2 KiB runs
    assert scatter.row_maps([short], sizes, torch.float32) is None
    short_rows = want((0, 0), (100, 1024), torch.empty(100, 2048)[:, 1024:])  # whole 4 KiB rows, strided
    assert scatter.row_maps([short_rows], sizes, torch.float32) is None
    rows = want((0, 0), (100, 2048), torch.empty(100, 4096)[:, 2048:])  # whole 8 KiB rows, strided
    assert scatter.row_maps([rows], (100, 2048), torch.float32) is not None
    strided = want((0, 0), (100, 1024), torch.empty(1024, 100).t())
    assert scatter.row_maps([strided], sizes, torch.float32) is None
    other_dtype = want((0, 0), (100, 1024), torch.empty(100, 1024, dtype=torch.bfloat16))
    assert scatter.row_maps([other_dtype], sizes, torch.float32) is None
    overlapping = [want((0, 0), (60, 1024), torch.empty(60, 1024)), want((50, 0), (50, 1024), torch.empty(50, 1024))]
    assert scatter.row_maps(overlapping, sizes, torch.float32) is None
    assert scatter.row_maps(overlapping[:1], sizes, torch.float32) is not None
    state = torch.randn(*sizes).repeat(4, 1)  # staged path still exact
    path = _save(tmp_path, state)
    out = torch.empty(400, 512)
    _read(path, [((0, 512), (400, 512), out)])
    assert torch.equal(_bits(out), _bits(state[:, 512:]))


@pytest.fixture
def no_scatter(monkeypatch):
    """Fails a read that scatters a window into its targets (the staged path is wanted)."""
    def scattered(*args, **kwargs):
        raise AssertionError("window scattered")
    monkeypatch.setattr(prefetch, "ScatterWindow", scattered)


@pytest.mark.parametrize("boxes", ["short runs", "strided rows", "overlapping"])
def test_a_damaged_block_fails_a_staged_window_and_leaves_its_targets(tmp_path, no_scatter, boxes):
    # the staged path (also every partial read into an accelerator's tensor) verifies each block of
    # its window against the block table before a byte is copied out of it
    state = torch.randn(1000, 1024)  # 4 KiB rows, 4 blocks
    path = _save(tmp_path, state)
    _flip(path, 2 * BLOCK_SIZE + 999)  # block 2: rows 512..767
    targets = {"short runs": [((400, 512), (300, 512), torch.full((300, 512), -1.0))],
               "strided rows": [((400, 0), (300, 1024), torch.full((1024, 300), -1.0).t())],
               "overlapping": [((400, 0), (200, 1024), torch.full((200, 1024), -1.0)),
                               ((500, 0), (200, 1024), torch.full((200, 1024), -1.0))]}[boxes]
    with pytest.raises(ckpt.CorruptCheckpointError, match="block 2 of"):
        _read(path, targets)
    for _, _, target in targets:
        assert torch.equal(target, torch.full(target.shape, -1.0))  # not one damaged byte copied


def test_a_damaged_block_fails_a_staged_load_of_a_strided_live_tensor(tmp_path, no_scatter):
    state = torch.randn(1000, 1024)
    path = _save(tmp_path, state)
    _flip(path, 3 * BLOCK_SIZE + 5)
    live = {"w": torch.full((1024, 1000), -1.0).t()}  # rows not contiguous: neither direct nor scattered
    with pytest.raises(ckpt.CorruptCheckpointError, match="block 3 of"):
        ckpt.load(live, path)
    assert torch.equal(live["w"], torch.full((1000, 1024), -1.0))


def test_scatter_reads_fill_every_buffer_in_order(tmp_path, monkeypatch):
    data = os.urandom(50_000)
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(_posix_io, "IOV_MAX", 3)  # several preadv calls, a buffer cut between two
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        for offset, sizes in [(0, [1, 2, 3, 4, 5, 6, 7]), (49_990, [4, 4, 4, 4]), (123, [10_000] * 5)]:
            buffers = [bytearray(n) for n in sizes]
            got = _posix_io.preadv_into(fd, [memoryview(b) for b in buffers], offset)
            assert got == min(sum(sizes), len(data) - offset)
            assert b"".join(buffers)[:got] == data[offset: offset + got]
    finally:
        os.close(fd)

    class Plain:  # a handle without scatter reads (an object store's): staged and copied out
        def read_into(self, buffer, offset):
            chunk = data[offset: offset + len(buffer)]
            buffer[: len(chunk)] = chunk
            return len(chunk)

    buffers = [bytearray(n) for n in (7, 1, 900)]
    assert read_scatter(Plain(), [memoryview(b) for b in buffers], 10) == 908
    assert b"".join(buffers) == data[10:918]

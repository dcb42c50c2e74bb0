"""Per-block checksums (format version 3): a rank reads only the blocks covering the bytes it needs
and verifies each before a byte is used; a damaged block fails exactly the reads that use it (a
rank that does not need it loads — decided so: each rank checks what it uses, ``ckpt-inspect
--verify`` checks everything); version-2 checkpoints (written the old way) still read and verify
whole; hostile block fields are refused before anything is allocated.

Single process: a partial read is driven through :func:`ckpt.read.prefetch.read_chunks` with the box a
rank of another layout would want (the multi-rank reshards are tests/ckpt/test_reshard.py and
tests/ckpt/test_load_memory.py).
"""

from __future__ import annotations

import json

import pytest
import torch

import ckpt
from ckpt.read import prefetch
from ckpt.format.blocks import BLOCK_SIZE
from ckpt.read.prefetch import Want, read_chunks
from ckpt.read.source import ChunkSource, verify_blobs
from ckpt.storage import local, locate
from tests.support.checkpoints import reseal
from tests.support.old_format import downgrade_to_v2
from tests.support.read_counting import counting_reads

ROWS, COLS = 1000, 1024  # fp32: 4 KiB rows, 4,096,000 bytes = 4 blocks (the last one short)


def _state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, COLS, generator=gen), "b": torch.randn(300, generator=gen), "step": 7}


def _blank() -> dict:
    return {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(300), "step": 0}


@pytest.fixture
def saved(tmp_path):
    state = _state()
    path = tmp_path / "ckpt"
    ckpt.save(state, path)
    return path, state


def _blob(path, key="w"):
    return ckpt.read_manifest(path).tensors[key].chunks[0].blob


def _flip(path, at: int) -> None:
    data = path / _blob(path).file
    raw = bytearray(data.read_bytes())
    raw[at] ^= 0x5A
    data.write_bytes(raw)


def _read_rows(path, r0: int, r1: int, cols=(0, COLS), reads=None):
    """Rows ``r0..r1`` (and columns ``cols``) of ``w`` as a rank of another layout reads them
    (``reads`` cleared once the manifest is read: it then records the data file's reads only)."""
    manifest = ckpt.read_manifest(path)
    if reads is not None:
        reads.clear()
    chunk = manifest.tensors["w"].chunks[0]
    out = torch.full((r1 - r0, cols[1] - cols[0]), -1.0)
    done = []
    want = Want((r0, cols[0]), (r1 - r0, cols[1] - cols[0]), lambda: out, done.append)
    with ChunkSource(locate(path), manifest) as source:
        source.files.check(chunk.blob, what="w")
        read_chunks(source, [("w", chunk, [want], None)])
    assert len(done) == 1 and done[0] is out
    return out


@pytest.fixture
def reads(monkeypatch):
    """Every positional read of a local data file: (offset, length)."""
    seen = []
    original, scatter = local.LocalReader.read_into, local.LocalReader.read_into_views

    def recording(self, buffer, offset):
        seen.append((offset, len(memoryview(buffer).cast("B"))))
        return original(self, buffer, offset)

    def recording_views(self, views, offset):
        seen.append((offset, sum(len(v) for v in views)))
        return scatter(self, views, offset)

    monkeypatch.setattr(local.LocalReader, "read_into", recording)
    monkeypatch.setattr(local.LocalReader, "read_into_views", recording_views)
    return seen


def test_version_3_blobs_longer_than_a_block_carry_blocks_and_round_trip_bitwise(saved):
    path, state = saved
    doc = json.loads((path / "manifest.json").read_bytes())
    assert doc["format_version"] == 3
    big, small = _blob(path, "w"), _blob(path, "b")
    assert big.block_size == BLOCK_SIZE and big.block_table >= big.offset + big.length
    assert small.block_size is None and small.block_table is None  # one block or less: whole-blob checksum
    assert ckpt.read_manifest(path).files[big.file] == big.block_table + 4 * 8  # the table is accounted
    live = _blank()
    ckpt.load(live, path)
    assert torch.equal(live["w"].view(torch.int32), state["w"].view(torch.int32))
    assert torch.equal(live["b"].view(torch.int32), state["b"].view(torch.int32)) and live["step"] == 7
    verify_blobs(locate(path), ckpt.read_manifest(path))


def test_a_partial_read_reads_only_the_blocks_covering_its_rows_and_its_table(saved, reads):
    path, state = saved
    blob = _blob(path)
    rows = _read_rows(path, 500, 600, reads=reads)  # bytes 2,048,000..2,457,600: blocks 1 and 2
    assert torch.equal(rows.view(torch.int32), state["w"][500:600].view(torch.int32))
    data = [(o, n) for o, n in reads if o < blob.block_table]
    assert data and min(o for o, _ in data) == blob.offset + BLOCK_SIZE
    assert sum(n for _, n in data) == 2 * BLOCK_SIZE
    assert [(o, n) for o, n in reads if o >= blob.block_table] == [(blob.block_table, 32)]


def test_a_column_slice_reads_its_rows_in_windows_and_copies_only_its_columns(saved, monkeypatch):
    path, state = saved
    monkeypatch.setattr(prefetch, "WINDOW_BYTES", 300 * COLS * 4)  # several windows, boundaries inside blocks
    cols = _read_rows(path, 0, ROWS, cols=(512, COLS))  # as Shard(0) -> Shard(1) wants it
    assert torch.equal(cols.view(torch.int32), state["w"][:, 512:].view(torch.int32))


@pytest.mark.parametrize("together", [True, False])
def test_files_other_ranks_read_too_are_read_in_turn_the_others_one_by_one(tmp_path, monkeypatch, together):
    """A rank that needs parts of chunks in two files other ranks read too (Shard(0) -> Shard(1)
    reads both ranks' files) reads a window of each in turn: the other file's pages, which another
    rank is pulling from storage meanwhile, are then copied while storage works. Files it alone
    reads go one after the other (they stream best that way)."""
    monkeypatch.setattr(prefetch, "WINDOW_BYTES", 256 * COLS * 4)  # 1 MiB: 4 windows a tensor
    state = {key: torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i))
             for i, key in enumerate(("a", "b"))}
    path = tmp_path / "ckpt"
    ckpt.save(state, path, files_per_rank=2)
    manifest = ckpt.read_manifest(path)
    chunks = {key: manifest.tensors[key].chunks[0] for key in state}
    files = {chunk.blob.file: key for key, chunk in chunks.items()}
    assert len(files) == 2
    outs = {key: torch.zeros(ROWS, COLS // 2) for key in state}
    requests = [(key, chunks[key], [Want((0, COLS // 2), (ROWS, COLS // 2), lambda k=key: outs[k], lambda t: None)],
                 None) for key in state]
    with counting_reads() as reads, ChunkSource(locate(path), manifest) as source:
        for chunk in chunks.values():
            source.files.check(chunk.blob, what="w")
        read_chunks(source, requests, together=frozenset(files) if together else frozenset(), threads=1)
    windows = [files[name] for name, _, n in reads.order if name in files and n >= BLOCK_SIZE // 2]
    assert windows == (["a", "b"] * 4 if together else ["a"] * 4 + ["b"] * 4)
    for key in state:
        assert torch.equal(outs[key].view(torch.int32), state[key][:, COLS // 2:].view(torch.int32))


@pytest.mark.parametrize("together", [True, False])
def test_a_rank_reading_files_side_by_side_keeps_one_more_read_in_flight_per_other_file(tmp_path, monkeypatch,
                                                                                          together):
    """Reading files side by side, a reader thread often waits on pages another rank is still
    pulling from storage: the rank gets one more reader per further file, so that its own file
    keeps reads in flight meanwhile. Files read one after another keep one reader per core."""
    pools = []

    class RecordingPool(prefetch.ThreadPoolExecutor):
        def __init__(self, max_workers, **kwargs):
            pools.append(max_workers)
            super().__init__(max_workers, **kwargs)

    monkeypatch.setattr(prefetch, "ThreadPoolExecutor", RecordingPool)
    state = {key: torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i))
             for i, key in enumerate(("a", "b", "c"))}
    path = tmp_path / "ckpt"
    ckpt.save(state, path, files_per_rank=3)
    manifest = ckpt.read_manifest(path)
    chunks = {key: manifest.tensors[key].chunks[0] for key in state}
    files = frozenset(chunk.blob.file for chunk in chunks.values())
    assert len(files) == 3
    outs = {key: torch.zeros(ROWS, COLS // 2) for key in state}
    requests = [(key, chunks[key], [Want((0, 0), (ROWS, COLS // 2), lambda k=key: outs[k], lambda t: None)], None)
                for key in state]
    with ChunkSource(locate(path), manifest) as source:
        for chunk in chunks.values():
            source.files.check(chunk.blob, what="w")
        read_chunks(source, requests, together=files if together else frozenset())
    assert pools == [prefetch.local_read_threads() + (2 if together else 0)]
    assert prefetch.local_read_threads(2) == prefetch.local_read_threads() + 1
    assert prefetch.local_read_threads(100) == prefetch.MAX_READ_THREADS
    for key in state:
        assert torch.equal(outs[key].view(torch.int32), state[key][:, :COLS // 2].view(torch.int32))


def test_a_damaged_block_fails_the_reads_that_use_it_and_only_those(saved):
    path, state = saved
    blob = _blob(path)
    _flip(path, blob.offset + 3 * BLOCK_SIZE + 100)  # in block 3 (rows 768..)
    rows = _read_rows(path, 0, 200)  # blocks 0: another rank's damage is not this rank's failure
    assert torch.equal(rows.view(torch.int32), state["w"][:200].view(torch.int32))
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch.*block 3") as info:
        _read_rows(path, 900, 1000)
    assert info.value.tensor == "w"
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        ckpt.load(_blank(), path)  # the whole chunk, read straight into the live tensor
    assert info.value.tensor == "w"
    failures = []
    verify_blobs(locate(path), ckpt.read_manifest(path), failed=lambda key, b, exc: failures.append((key, str(exc))))
    assert len(failures) == 1 and failures[0][0] == "w" and "block 3" in failures[0][1]


def test_a_damaged_block_table_fails_partial_reads_and_verify_not_whole_loads(saved):
    path, state = saved
    blob = _blob(path)
    _flip(path, blob.block_table + 9)
    with pytest.raises(ckpt.CorruptCheckpointError, match="block table"):
        _read_rows(path, 0, 10)
    live = _blank()
    ckpt.load(live, path)  # a whole read rebuilds the table from the bytes: still every byte verified
    assert torch.equal(live["w"].view(torch.int32), state["w"].view(torch.int32))
    with pytest.raises(ckpt.CorruptCheckpointError, match="block table"):
        verify_blobs(locate(path), ckpt.read_manifest(path))


def test_parallel_pieces_each_verified(saved, monkeypatch):
    path, state = saved
    monkeypatch.setattr(prefetch, "PIECE_BYTES", BLOCK_SIZE)  # 4 pieces in flight for one chunk
    live = _blank()
    ckpt.load(live, path)
    assert torch.equal(live["w"].view(torch.int32), state["w"].view(torch.int32))
    _flip(path, _blob(path).offset + 2 * BLOCK_SIZE + 5)
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch"):
        ckpt.load(_blank(), path)


def test_a_compressed_chunk_has_blocks_over_its_stored_bytes_and_is_read_whole(tmp_path, reads):
    import torch.distributed.checkpoint as dcp

    from ckpt.dcp import Writer

    state = {"w": torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(4)).bfloat16().float()}
    path = tmp_path / "z"
    dcp.save(state, storage_writer=Writer(path, compress="zstd"), no_dist=True)
    blob = _blob(path)
    assert blob.codec == "planes" and blob.length > BLOCK_SIZE and blob.block_size == BLOCK_SIZE
    rows = _read_rows(path, 10, 20, reads=reads)
    assert torch.equal(rows, state["w"][10:20])
    assert sum(n for o, n in reads if o < blob.block_table) == blob.length  # a part needs the whole chunk


def test_version_2_checkpoints_still_load_and_verify_whole(saved, reads):
    path, state = saved
    assert downgrade_to_v2(path) == 1
    doc = json.loads((path / "manifest.json").read_bytes())
    assert doc["format_version"] == 2 and "block_size" not in json.dumps(doc)
    live = _blank()
    ckpt.load(live, path)
    assert torch.equal(live["w"].view(torch.int32), state["w"].view(torch.int32))
    rows = _read_rows(path, 500, 600, reads=reads)  # no blocks: the whole blob is read and checked
    assert torch.equal(rows.view(torch.int32), state["w"][500:600].view(torch.int32))
    assert sum(n for _, n in reads) == _blob(path).length
    verify_blobs(locate(path), ckpt.read_manifest(path))
    _flip(path, _blob(path).offset + 3 * BLOCK_SIZE)
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch"):
        ckpt.load(_blank(), path)
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch"):
        _read_rows(path, 0, 10)


def _edit_blob(path, **fields):
    def mutate(doc):
        doc["tensors"]["w"]["chunks"][0].update(fields)
    reseal(path, mutate)


@pytest.mark.parametrize("size", [1000, 1 << 12, 1 << 30, -1, True, "1048576"])
def test_a_hostile_block_size_is_refused(saved, size):
    path, _ = saved
    _edit_blob(path, block_size=size)
    with pytest.raises(ckpt.InvalidManifestError, match="block_size"):
        ckpt.read_manifest(path)


def test_block_fields_in_a_version_2_manifest_are_refused(saved):
    path, _ = saved
    reseal(path, lambda doc: doc.update(format_version=2))
    with pytest.raises(ckpt.InvalidManifestError, match="version-2"):
        ckpt.read_manifest(path)


def test_a_block_table_beyond_its_file_is_refused_before_it_is_read(saved):
    path, _ = saved
    _edit_blob(path, block_table=1 << 40)
    with pytest.raises(ckpt.CorruptCheckpointError, match="truncated"):
        _read_rows(path, 0, 10)
    _edit_blob(path, block_table=1 << 51)
    with pytest.raises(ckpt.InvalidManifestError, match="block_table"):
        ckpt.read_manifest(path)


def test_partial_reads_from_s3_read_only_their_blocks(s3_bucket):
    state = _state(1)
    url = f"{s3_bucket.url}/blocks"
    ckpt.save(state, url, storage_options=s3_bucket.storage_options)
    location = locate(url, s3_bucket.storage_options)
    manifest = ckpt.read_manifest(location)
    chunk = manifest.tensors["w"].chunks[0]
    out = torch.empty(100, COLS)
    with ChunkSource(location, manifest) as source:
        source.files.check(chunk.blob, what="w")
        read_chunks(source, [("w", chunk, [Want((500, 0), (100, COLS), lambda: out, lambda t: None)], None)])
    assert torch.equal(out.view(torch.int32), state["w"][500:600].view(torch.int32))
    live = _blank()
    ckpt.load(live, url, storage_options=s3_bucket.storage_options)
    assert torch.equal(live["w"].view(torch.int32), state["w"].view(torch.int32))


@pytest.mark.parametrize("length", [0, 5, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 17])
def test_a_streamed_digest_equals_the_whole_blob_digest_whatever_the_pieces(length):
    from ckpt.format.blocks import StreamDigest, blob_digest

    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length)).numpy()
    for piece in (1 << 16, 3 * 1000 + 7, 16 << 20):
        stream = StreamDigest(BLOCK_SIZE)
        for start in range(0, length, piece):
            stream.update(data[start:start + piece])
        assert stream.hexdigest() == blob_digest(data, BLOCK_SIZE)


def test_a_copied_version_3_step_verifies_block_by_block(saved, tmp_path):
    from ckpt.root import copy_step

    path, state = saved
    target = tmp_path / "replica" / "ckpt"
    copy_step(locate(path), locate(target), read_back=True)
    live = _blank()
    ckpt.load(live, target)
    assert torch.equal(live["w"].view(torch.int32), state["w"].view(torch.int32))
    assert torch.equal(_read_rows(target, 0, 300).view(torch.int32), state["w"][:300].view(torch.int32))


def test_a_damaged_block_stops_the_copy(saved, tmp_path):
    from ckpt.root import copy_step

    path, _ = saved
    _flip(path, _blob(path).offset + 2 * BLOCK_SIZE + 1)
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch"):
        copy_step(locate(path), locate(tmp_path / "replica" / "ckpt"))
    assert not (tmp_path / "replica" / "ckpt").exists()


def test_a_damaged_block_table_stops_the_copy_even_without_read_back(saved, tmp_path):
    from ckpt.root import copy_step
    from ckpt.root.copy import SourceCorruptError

    path, _ = saved
    _flip(path, _blob(path).block_table + 3)
    with pytest.raises(SourceCorruptError, match="block table"):
        copy_step(locate(path), locate(tmp_path / "replica" / "ckpt"))
    assert not (tmp_path / "replica" / "ckpt").exists()

"""A refused load leaves the live state as it was, on every read path (:mod:`ckpt.read.rollback`).

Each test damages what one read path reads last (a flipped byte in a chunk, a data file cut inside
its block tables) so that the load has written other tensors — and, reading straight into the live
tensor, the damaged bytes themselves — before it finds the damage; it must fail, and every live
tensor must then be bitwise what it was before the load, plain values too. Paths: direct reads into
the live tensor, staged windows (a strided live tensor), whole reads (compressed chunks), batched
small reads from an object store (real moto server); the multi-rank paths — scatter reads of a
resharded load, chunks shared between ranks, bytes damaged in transit, a peer that dies mid-exchange
— are in tests/ckpt/test_read_exchange_faults.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.api import write_tree
from ckpt.dcp import Writer
from ckpt.state import export_state
from tests.support.s3server import bucket_fs


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(256, 1024, generator=g),  # 1 MiB
            "b": torch.randn(700, 1024, generator=g),  # 2.7 MiB: blocks
            "c": torch.randint(0, 100, (4000,), generator=g),
            "step": seed}


def _live() -> dict:
    state = _state(99)
    state["step"] = -1
    return state


def _snapshot(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _assert_untouched(live: dict, before: dict) -> None:
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            now, was = live[key].contiguous(), value.contiguous()
            assert now.shape == was.shape and torch.equal(now.view(torch.uint8), was.view(torch.uint8)), key
        else:
            assert live[key] == value, key


def _last(manifest) -> tuple[str, object]:
    """The tensor whose chunk lies last in its data file, and that chunk's blob (read last)."""
    return max(((key, entry.chunks[0].blob) for key, entry in manifest.tensors.items()),
               key=lambda pair: pair[1].offset)


def _flip(path, blob, at: int) -> None:
    data = path / blob.file
    raw = bytearray(data.read_bytes())
    raw[blob.offset + at] ^= 0x01
    data.write_bytes(raw)


def test_a_damaged_chunk_read_into_its_live_tensor_is_put_back_with_every_other(tmp_path):
    path = tmp_path / "ckpt"
    ckpt.save(_state(1), path)
    key, blob = _last(ckpt.read_manifest(path))
    _flip(path, blob, blob.length - 3)  # found only once every other chunk and this one landed
    live = _live()
    before = _snapshot(live)
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        ckpt.load(live, path)
    assert info.value.tensor == key
    _assert_untouched(live, before)
    ckpt.save(_state(1), tmp_path / "good")
    ckpt.load(live, tmp_path / "good")  # the same live state still loads, in place
    assert torch.equal(live["b"], _state(1)["b"]) and live["step"] == 1


def test_a_damaged_block_of_a_staged_window_leaves_the_tensors_loaded_before_it(tmp_path):
    path = tmp_path / "ckpt"
    state = _state(1)
    ckpt.save(state, path)
    manifest = ckpt.read_manifest(path)
    blob = manifest.tensors["b"].chunks[0].blob
    assert blob.block_size is not None and _last(manifest)[0] != "a"
    _flip(path, blob, 2 * blob.block_size + 17)
    live = _live()
    live["b"] = torch.full((1024, 700), 5.0).t()  # rows not contiguous: a staged window
    before = _snapshot(live)
    with pytest.raises(ckpt.CorruptCheckpointError, match="block 2 of"):
        ckpt.load(live, path)
    _assert_untouched(live, before)


def test_a_damaged_compressed_chunk_read_whole_leaves_the_others(tmp_path):
    path = tmp_path / "ckpt"
    tree, _ = export_state(_state(1))
    write_tree(tree, Writer(path, compress="zstd"), process_group=None, no_dist=True)
    key, blob = _last(ckpt.read_manifest(path))
    assert blob.codec != "raw"
    _flip(path, blob, blob.length // 2)
    live = _live()
    before = _snapshot(live)
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.load(live, path)
    _assert_untouched(live, before)


@pytest.mark.parametrize("rollback", [True, False])
def test_a_file_cut_inside_its_block_tables_is_refused_before_a_byte_changes(tmp_path, rollback):
    path = tmp_path / "ckpt"
    ckpt.save(_state(1), path)
    blob = ckpt.read_manifest(path).tensors["b"].chunks[0].blob
    data = path / blob.file
    data.write_bytes(data.read_bytes()[: blob.block_table + 8])  # every payload whole, b's table cut
    live = _live()
    before = _snapshot(live)
    with pytest.raises(ckpt.CorruptCheckpointError, match="block table of b"):
        ckpt.load(live, path, rollback=rollback)  # checked with the blobs: nothing to roll back
    _assert_untouched(live, before)


def test_a_damaged_small_tensor_of_a_batch_leaves_its_neighbours(s3_bucket):
    gen = torch.Generator().manual_seed(3)
    state = {f"norm.{i:02d}": torch.randn(64 + 37 * i, generator=gen) for i in range(30)}
    url = f"{s3_bucket.url}/batch"
    ckpt.save(state, url, storage_options=s3_bucket.storage_options)
    key, blob = _last(ckpt.read_manifest(url, storage_options=s3_bucket.storage_options))
    fs = bucket_fs(s3_bucket)
    name = f"{s3_bucket.name}/batch/{blob.file}"
    raw = bytearray(fs.cat_file(name))
    raw[blob.offset + 1] ^= 0x10
    fs.pipe_file(name, bytes(raw))
    live = {k: torch.full_like(v, -2.0) for k, v in state.items()}
    before = _snapshot(live)
    with pytest.raises(ckpt.CorruptCheckpointError, match="checksum mismatch") as info:
        ckpt.load(live, url, storage_options=s3_bucket.storage_options)
    assert info.value.tensor == key
    _assert_untouched(live, before)


def test_a_module_and_optimizer_are_left_as_they_were(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 700))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optim.step()
    path = tmp_path / "ckpt"
    ckpt.save({"model": model, "optim": optim}, path)
    key, blob = _last(ckpt.read_manifest(path))
    _flip(path, blob, blob.length - 1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optim.state[next(model.parameters())].items()}
    with pytest.raises(ckpt.CorruptCheckpointError):
        ckpt.load({"model": model, "optim": optim}, path)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in optim.state[next(model.parameters())].items():
        assert torch.equal(v, moments[k]), k


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_the_undo_copy_is_the_bytes_loaded_once_and_gone_when_the_load_returns(tmp_path):
    # what the rollback costs, bounded: one host copy of what the load writes (here 80 MiB read
    # straight into the live tensors), not two, and none left after the load (tensors of 40 MiB:
    # above glibc's largest mmap threshold, so a freed copy leaves the resident set)
    state = {f"w{i}": torch.randn(4096, 2560, generator=torch.Generator().manual_seed(i)) for i in range(2)}
    ckpt.save(state, tmp_path / "ckpt")
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    loaded = sum(v.numel() * v.element_size() for v in live.values())
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
    except OSError:
        pytest.skip("cannot reset the peak resident set here")
    before = _status("VmRSS")
    ckpt.load(live, tmp_path / "ckpt")
    peak, after = _status("VmHWM"), _status("VmRSS")
    assert all(torch.equal(live[k], state[k]) for k in state)
    assert peak - before < loaded + (32 << 20)  # one copy plus slack for threads and allocator
    assert after - before < 32 << 20  # the copies are freed once the load succeeded

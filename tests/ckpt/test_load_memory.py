"""Memory on resume is bounded: a resharded load's peak host memory is the live state plus the read
buffer (``ckpt.read.prefetch.BUFFER_BYTES``), never a whole stored chunk.

Two spawned ranks save a 200 MB fp32 matrix as ``Shard(0)`` (one 100 MB chunk each), then load it
as ``Shard(1)``: each rank needs half of every row of both chunks, the layout that used to stage a
whole chunk per read. Each rank measures its own peak resident set during the load (``VmHWM``
after resetting it through ``/proc/self/clear_refs``) against its resident set before it; the bound
asserted is the read buffer plus 32 MiB for threads and allocator slack — well below one chunk
(100 MB), so staging a chunk fails the test. A bound, not a timing. Measured with
``rollback=False``: the undo copy ``ckpt.load`` keeps by default (:mod:`ckpt.read.rollback`) is by
design as large as the bytes a rank loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt
from ckpt.read.prefetch import BUFFER_BYTES
from tests.support.launch import run_ranks

pytestmark = pytest.mark.slow  # 2 ranks, 200 MB saved and loaded

ROWS, COLS = 12800, 4096  # fp32: 200 MiB ≈ 210 MB
SLACK = 32 << 20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _save_then_load_resharded(rank: int, world: int, directory: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full(11)
    ckpt.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, directory)
    expected = full[:, rank * COLS // world:(rank + 1) * COLS // world].clone()
    del full
    live = {"w": distribute_tensor(torch.full((ROWS, COLS), -1.0), mesh, [Shard(1)])}  # resident already
    local = live["w"].to_local()
    torch.distributed.barrier()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
    except OSError:
        return {"skipped": True}
    before = _status("VmRSS")
    ckpt.load(live, directory, rollback=False)  # the read path's memory, without the undo copy
    peak = _status("VmHWM")
    assert torch.equal(live["w"].to_local().view(torch.int32), expected.view(torch.int32))
    assert live["w"].to_local().data_ptr() == local.data_ptr()  # in place
    return {"skipped": False, "growth": peak - before, "live": local.nbytes,
            "chunk": ROWS // world * COLS * 4}


def test_a_resharded_load_peaks_at_the_live_state_plus_the_read_buffer(tmp_path):
    results = run_ranks(2, _save_then_load_resharded, str(tmp_path / "ckpt"))
    if any(r["skipped"] for r in results):
        pytest.skip("/proc/self/clear_refs cannot be written here")
    for rank, result in enumerate(results):
        assert BUFFER_BYTES + SLACK < result["chunk"]  # the bound is below what staging a chunk costs
        assert result["growth"] <= BUFFER_BYTES + SLACK, (rank, result)

"""ckpt.staging: DoubleBufferStager under plain dcp.async_save (exact snapshot, buffer sets reused and
bounded), and a delta's base buffer set held until the delta's write ends."""

from __future__ import annotations

import threading

import torch
import torch.distributed.checkpoint as dcp

import ckpt
from ckpt.staging import DoubleBufferStager


def test_stager_with_plain_dcp_async_save(tmp_path):
    stager = DoubleBufferStager()
    state = {"w": torch.randn(300, 300), "meta": {"epoch": 1}}
    expected = state["w"].clone()
    response = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(tmp_path / "a"), async_stager=stager, no_dist=True)
    stager.track(response.upload_completion)  # releases the buffer set when the write is done
    stager.wait_snapshot()
    state["w"].add_(1.0)  # after the snapshot: must not reach the file
    state["meta"]["epoch"] = 2
    response.upload_completion.result()
    first_buffers = stager.host_bytes
    response = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(tmp_path / "b"), async_stager=stager, no_dist=True)
    response.upload_completion.result()
    assert stager.host_bytes == first_buffers == 300 * 300 * 4  # one set reused: no second allocation
    for name in ("c", "d", "e"):  # untracked: DCP's contract (one async_save in flight) frees sets
        response = dcp.async_save(state, storage_writer=ckpt.dcp.Writer(tmp_path / name), async_stager=stager,
                                  no_dist=True)
        response.upload_completion.result()
    assert stager.host_bytes == 2 * 300 * 300 * 4
    out = {"w": torch.zeros(300, 300), "meta": {"epoch": 0}}
    ckpt.load(out, tmp_path / "a")
    assert torch.equal(out["w"], expected) and out["meta"] == {"epoch": 1}
    stager.close()
    assert stager.host_bytes == 0


def test_a_base_buffer_set_stays_held_until_the_delta_write_ends():
    """Sets: A <- step 1; B <- step 2 (delta on A, holds A); step 3 (delta on B) waits for step 2's
    write, takes A and must keep holding B until step 3's write ends, even though step 2's write,
    which B was released by before, has finished."""
    from concurrent.futures import Future

    stager = DoubleBufferStager()
    state = {"w": torch.zeros(8)}
    writes = [Future() for _ in range(3)]
    stager.stage(state).result()
    stager.track(writes[0])
    stager.stage(state, keep_previous=True).result()
    stager.track(writes[1])
    writes[0].set_result(None)
    assert not stager.has_free_set()  # A is step 2's base, B its source
    staged = []
    third = threading.Thread(target=lambda: staged.append(stager.stage(state, keep_previous=True)))
    third.start()
    writes[1].set_result(None)  # frees A (and would have freed B)
    third.join(timeout=30)
    assert staged, "step 3 never got a buffer set"
    stager.track(writes[2])
    assert not stager.has_free_set()  # B is held as step 3's base until writes[2] ends
    writes[2].set_result(None)
    assert stager.has_free_set()
    stager.close()

"""ckpt.write.staging: DoubleBufferStager under plain dcp.async_save (exact snapshot, buffer sets reused and
bounded), a delta's base buffer set held until the delta's write ends, staged DTensors that stay on
the host on a device mesh (a set's wrappers reused while the spec is the same), values captured at
stage time (immutable ones by reference), and host buffers (power-of-two pinned segments; a layout change keeps no
set of the old layout). How pinned memory is given back: tests/ckpt/test_host_memory.py."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.multiprocessing.reductions import StorageWeakRef

import ckpt
from ckpt.write.host_buffers import plan_layout
from ckpt.write.staging import DoubleBufferStager


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


def test_a_second_write_of_a_freed_snapshot_holds_its_set_again():
    """A snapshot written twice (Lightning's top-k file, then ``last.ckpt`` of the same step): the
    first write ends and frees the set; tracking the second write must hold it again, or the next
    snapshot may be copied over the bytes the second write is still reading."""
    from concurrent.futures import Future

    stager = DoubleBufferStager(policy="skip")
    state = {"w": torch.zeros(8)}
    first, second, other = Future(), Future(), Future()
    stager.stage(state).result()
    stager.track(first)
    first.set_result(None)  # the set is free again
    stager.track(second)  # the same snapshot, written to another path
    stager.stage(state).result()  # takes the other set
    stager.track(other)
    with pytest.raises(ckpt.SnapshotSkipped):  # both sets are being read
        stager.stage(state)
    second.set_result(None)
    stager.stage(state).result()
    stager.close()


@pytest.fixture
def device_mesh_stand_in():
    """A 2-rank mesh over torch's fake process group whose device type is not the host's: what
    ``DTensor.from_local`` does on a GPU/NPU mesh (move its input to the mesh's device) it does here
    too, to the meta device, where no bytes exist."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        yield mesh
    finally:
        dist.destroy_process_group()


def test_a_staged_dtensor_stays_around_its_host_buffer(device_mesh_stand_in):
    mesh = device_mesh_stand_in
    live = DTensor.from_local(torch.randn(6, 4), mesh, [Shard(0)], run_check=False)
    mesh._device_type = "meta"  # now from_local would move a host view off the host
    stager = DoubleBufferStager()
    staged = stager.stage({"w": live}).result()["w"]
    local = staged.to_local()
    (buffers,) = [b for b in stager.sets if b.memory is not None]
    assert local.device.type == "cpu"
    assert local.data_ptr() == buffers.views[0].data_ptr()  # the snapshot's own bytes, not a copy
    assert torch.equal(local, live.to_local())
    assert staged.shape == live.shape and staged.placements == live.placements
    assert staged.device_mesh is mesh and not staged.requires_grad
    stager.close()


def test_a_set_reuses_its_dtensor_wrappers_only_for_the_same_spec(device_mesh_stand_in):
    mesh = device_mesh_stand_in
    sharded = DTensor.from_local(torch.randn(6, 4), mesh, [Shard(0)], run_check=False)
    replicated = DTensor.from_local(torch.randn(6, 4), mesh, [Replicate()], run_check=False)  # the same local shape
    stager = DoubleBufferStager()
    staged = [stager.stage({"w": live}).result()["w"] for live in (sharded, sharded, sharded, replicated)]
    assert staged[2] is staged[0] and staged[1] is not staged[0]  # sets alternate; each keeps its own
    assert staged[3].placements == replicated.placements and staged[3].shape == replicated.shape
    assert torch.equal(staged[3].to_local(), replicated.to_local())
    stager.close()


def test_values_are_captured_at_stage_time_immutable_ones_by_reference():
    from ckpt.format.values import Leaf

    betas, config = (0.9, 0.999), {"sizes": [1, 2]}
    state = {"lr": 0.1, "name": "adam", "betas": Leaf(betas), "config": Leaf(config), "loose": {"ids": [3]},
             "pair": (torch.ones(2), [4]), "w": torch.zeros(3)}
    stager = DoubleBufferStager()
    staged = stager.stage(state).result()
    config["sizes"].append(3)
    state["loose"]["ids"].append(5)
    state["pair"][1].append(6)
    assert staged["betas"].value is betas and staged["name"] is state["name"] and staged["lr"] == 0.1
    assert staged["config"].value == {"sizes": [1, 2]} and staged["loose"] == {"ids": [3]}
    assert type(staged["pair"]) is tuple and staged["pair"][1] == [4] and torch.equal(staged["pair"][0], torch.ones(2))
    stager.close()


def test_pinned_sets_are_power_of_two_segments_with_little_waste():
    """The caching host allocator rounds every block up to a power of two: 10.65 GiB asked as one
    block reserves 16 GiB. Segments of power-of-two sizes reserve what is asked."""
    mib = 1 << 20
    sizes = [300 * mib] * 2 + [48 * mib] * 200 + [3 * mib + 7] * 500  # ~11.7 GiB, one tensor above 256 MiB
    layout = plan_layout(sizes, pinned=True)
    assert all(size & (size - 1) == 0 for size in layout.sizes)
    assert sum(layout.sizes) <= sum(sizes) + 512 * mib  # below one segment (512 MiB here) of waste
    ends = {}
    for (segment, offset), n in zip(layout.places, sizes):  # no overlap, everything inside its segment
        assert offset % 64 == 0 and offset + n <= layout.sizes[segment]
        ends.setdefault(segment, []).append((offset, offset + n))
    for spans in ends.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    exact = plan_layout(sizes, pinned=False)
    assert exact.sizes == (sum(-(-n // 64) * 64 for n in sizes),)


def test_a_layout_change_keeps_no_set_of_the_old_layout():
    """Both sets hold the old layout and are free again: the new layout's snapshot leaves one set of
    the new layout and nothing of the old one (not the old and the new sets together)."""
    from concurrent.futures import Future

    stager = DoubleBufferStager(pin_memory=False)
    writes = [Future(), Future()]
    for write in writes:  # each set busy until its write ends: two sets of the old layout
        stager.stage({"w": torch.zeros(1000)}, release=write).result()
    old = [StorageWeakRef(b.memory.segments[0].untyped_storage()) for b in stager.sets]
    for write in writes:
        write.set_result(None)
    staged = stager.stage({"w": torch.ones(10)}).result()
    assert all(segment.expired() for segment in old)
    assert stager.host_bytes == 64 and torch.equal(staged["w"], torch.ones(10))
    (new,) = [StorageWeakRef(b.memory.segments[0].untyped_storage()) for b in stager.sets if b.memory is not None]
    del staged
    stager.close()
    assert new.expired() and stager.host_bytes == 0

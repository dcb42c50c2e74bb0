"""The staging path on a real accelerator (CUDA GPU or Ascend NPU; skipped elsewhere, so on CI):
pinned host buffers (given back by close), snapshot ordering against delayed in-place writes, the
lifetime of a temporary source while its (held back) copy is pending, with the negative control that
shows the check can see a reused block, DTensors on a device mesh staged without a device copy, and a
manager save of a 1-rank FSDP2 model and its optimizer loaded bitwise. ``benchmarks/device_checks.py``
runs these as its ordering section (``pytest -m accelerator``)."""

from __future__ import annotations

import contextlib
import socket

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt.device import accelerator_module, empty_host_cache, process_group_backend, resolve_device_type
from ckpt.write.snapshot_copy import SnapshotCopy
from ckpt.write.staging import DoubleBufferStager

DEVICE_TYPE = resolve_device_type("auto")
ACCEL = accelerator_module(DEVICE_TYPE)
pytestmark = [pytest.mark.accelerator,
              pytest.mark.skipif(ACCEL is None, reason="needs a CUDA GPU or an Ascend NPU")]


def _delay(stream=None, milliseconds: float = 50.0) -> None:
    """Keep ``stream`` (default: the current, compute stream) busy for a while, so that what is
    queued on it after this runs late."""
    with contextlib.nullcontext() if stream is None else ACCEL.stream(stream):
        if DEVICE_TYPE == "cuda":
            torch.cuda._sleep(int(milliseconds * 2e6))  # ~2 GHz cycles
        else:  # no sleep kernel on NPU: a chain of matrix products
            a = torch.randn(4096, 4096, device=DEVICE_TYPE)
            for _ in range(int(milliseconds)):
                a = a @ a / 4096


class HeldBackCopy(SnapshotCopy):
    """The snapshot copy engine with its side stream held back 200 ms before each copy: the copy
    reads its sources long after ``stage()`` has returned and the caller has moved on."""

    def _copy_on_side_stream(self, device, pairs):
        if device not in self._streams:
            self._streams[device] = self.accel.Stream(device=device)
        _delay(self._streams[device], 200.0)
        return super()._copy_on_side_stream(device, pairs)


class HeldBackStager(DoubleBufferStager):
    copy_engine = HeldBackCopy


@pytest.fixture(scope="module")
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ACCEL.set_device(0)
    dist.init_process_group(process_group_backend(DEVICE_TYPE), init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, device_id=torch.device(DEVICE_TYPE, 0))
    yield
    dist.destroy_process_group()


def test_host_buffers_are_pinned_including_offset_views():
    stager = DoubleBufferStager(DEVICE_TYPE)
    state = {"a": torch.randn(1000, device=DEVICE_TYPE), "b": torch.randn(333, 7, device=DEVICE_TYPE)}
    staged = stager.stage(state).result()
    assert all(segment.is_pinned() for b in stager.sets if b.memory for segment in b.memory.segments)
    assert staged["b"].is_pinned() and staged["b"].data_ptr() % 64 == 0  # a view at an offset
    stager.close()


def test_close_gives_the_pinned_memory_back_after_a_layout_change():
    """The host allocator's own figure (active + cached pinned bytes) returns to where it started."""
    stats = getattr(ACCEL, "host_memory_stats", None)
    if stats is None:
        pytest.skip("this build's host allocator has no statistics")

    def held() -> int:
        return int(stats().get("allocated_bytes.current", 0))

    empty_host_cache(DEVICE_TYPE)
    before = held()
    stager = DoubleBufferStager(DEVICE_TYPE)
    for n in (1 << 20, 3 << 20):  # a layout change between the two snapshots
        stager.stage({"w": torch.randn(n, device=DEVICE_TYPE)}).result()
    assert held() > before
    stager.close()
    assert held() == before


def test_a_snapshot_holds_the_value_written_before_it_even_when_the_write_runs_late():
    x = torch.zeros(1 << 20, device=DEVICE_TYPE)
    stager = DoubleBufferStager(DEVICE_TYPE)
    _delay()
    x.add_(1.0)  # queued behind the delay: the copy must wait for it
    future = stager.stage({"x": x})
    stager.wait_snapshot()  # what the optimizer pre-hook does
    _delay()
    x.add_(1.0)  # after the wait: must not reach the snapshot
    assert torch.equal(future.result()["x"], torch.ones(1 << 20))
    ACCEL.synchronize()
    assert float(x[0]) == 2.0
    stager.close()


def test_a_temporary_source_outlives_its_held_back_copy():
    """The only reference to a temporary (what ``state_dict()`` makes) is the snapshot's: while its
    copy is pending, the caching allocator must not hand its block to the next allocation of the
    compute stream (the stager holds the source and marks it in use by the copy stream)."""
    ACCEL.empty_cache()  # no other free block of this size for the allocator to pick
    base = torch.randn(1 << 24, device=DEVICE_TYPE)  # 64 MiB
    temporary = base * 2
    expected, block = temporary.cpu(), temporary.data_ptr()
    stager = HeldBackStager(DEVICE_TYPE)
    future = stager.stage({"t": temporary})
    del temporary
    reuse = torch.full_like(base, -7.0)  # same size, same stream: a freed block would be this one
    assert reuse.data_ptr() != block
    assert torch.equal(future.result()["t"], expected)
    stager.close()


def test_negative_control_an_unprotected_held_back_copy_reads_the_reused_block():
    """The same held-back copy of a temporary, made by hand without the stager's protection (no
    reference held, no ``record_stream``): the next allocation gets the block and the copy reads its
    bytes. Shows that the test above can see the race it guards against."""
    ACCEL.empty_cache()
    base = torch.randn(1 << 24, device=DEVICE_TYPE)
    host = torch.empty(base.shape, dtype=base.dtype, pin_memory=True)
    side = ACCEL.Stream()
    temporary = base * 2
    expected, block = temporary.cpu(), temporary.data_ptr()
    side.wait_stream(ACCEL.current_stream())
    _delay(side, 200.0)
    with ACCEL.stream(side):
        host.copy_(temporary, non_blocking=True)
    del temporary
    reuse = torch.full_like(base, -7.0)
    side.synchronize()
    assert reuse.data_ptr() == block
    assert not torch.equal(host, expected) and bool((host == -7.0).all())


def test_a_dtensor_on_a_device_mesh_is_staged_on_the_host_without_a_device_copy(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(DEVICE_TYPE, (1,))
    live = distribute_tensor(torch.randn(4096, 1024, device=DEVICE_TYPE), mesh, [Shard(0)])
    stager = DoubleBufferStager(DEVICE_TYPE)
    stager.stage({"w": live}).result()  # buffers allocated
    stager.wait_snapshot(host=True)
    ACCEL.synchronize()
    before = ACCEL.memory_allocated()
    staged = stager.stage({"w": live})
    during = ACCEL.memory_allocated()
    local = staged.result()["w"].to_local()
    assert during - before < live.to_local().nbytes // 4  # no second copy of the state on the device
    assert local.device.type == "cpu" and local.is_pinned()
    assert torch.equal(local, live.to_local().cpu())
    stager.close()


def _on_host(value):
    """A state dict with every tensor as a host copy (a DTensor as its full value)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_host(v) for v in value)
    if isinstance(value, DTensor):
        return value.full_tensor().cpu().clone()
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _bitwise_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_bitwise_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_a_manager_save_of_an_fsdp2_model_and_its_optimizer_loads_bitwise(one_rank_group, tmp_path):
    from torch.distributed.fsdp import fully_shard

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
        model.to(DEVICE_TYPE)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, optim = build(0)
    with ckpt.CheckpointManager(tmp_path, interval=1, keep=2) as manager:
        manager.attach(optim)
        for step in (1, 2):
            model(torch.randn(8, 256, device=DEVICE_TYPE)).square().mean().backward()
            optim.step()
            optim.zero_grad()
            manager.save(step, {"model": model, "optim": optim})
        expected = _on_host({"model": model.state_dict(), "optim": optim.state_dict()})
        model(torch.randn(8, 256, device=DEVICE_TYPE)).square().mean().backward()
        optim.step()  # after the save: must not reach it
    fresh, fresh_optim = build(1)
    ckpt.load({"model": fresh, "optim": fresh_optim}, tmp_path / "step-00000002")
    loaded = _on_host({"model": fresh.state_dict(), "optim": fresh_optim.state_dict()})
    assert loaded["optim"]["state"] and loaded["optim"]["state"].keys() == expected["optim"]["state"].keys()
    assert _bitwise_equal(loaded["model"], expected["model"])
    assert _bitwise_equal(loaded["optim"], expected["optim"])

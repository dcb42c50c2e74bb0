"""Device/backend resolution, with torch_npu imported lazily, and the accelerator staging path
driven through a stand-in accelerator module (this machine has neither NPU nor GPU)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from ckpt import device
from ckpt.staging import DoubleBufferStager


class _Event:
    def __init__(self):
        self.recorded_on = None
        self.synchronized = False

    def record(self, stream=None):
        self.recorded_on = stream

    def synchronize(self):
        self.synchronized = True


class _Stream:
    def __init__(self, name="side"):
        self.name, self.waited_streams, self.waited_events = name, [], []

    def wait_stream(self, other):
        self.waited_streams.append(other)

    def wait_event(self, event):
        self.waited_events.append(event)


def _fake_npu():
    compute = _Stream("compute")
    module = types.SimpleNamespace(
        is_available=lambda: True, Stream=_Stream, Event=_Event, current_stream=lambda: compute,
        stream=lambda s: __import__("contextlib").nullcontext(), device_count=lambda: 8,
    )
    return module, compute


@pytest.fixture
def fake_torch_npu(monkeypatch):
    npu, compute = _fake_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu, compute


def test_backends():
    assert [device.backend_for(d) for d in ("npu", "cuda", "cpu")] == ["hccl", "nccl", "gloo"]
    assert device.process_group_backend("npu") == "cpu:gloo,npu:hccl"
    assert device.process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert device.process_group_backend("cpu") == "gloo"
    with pytest.raises(ValueError):
        device.backend_for("tpu")


def test_cpu_resolution_without_accelerators():
    assert "torch_npu" not in sys.modules  # nothing imported it eagerly
    assert device.resolve_device_type("auto") == "cpu"
    assert device.resolve_device_type("cpu") == "cpu"
    with pytest.raises(device.DeviceUnavailableError, match="torch_npu"):
        device.resolve_device_type("npu")
    with pytest.raises(device.DeviceUnavailableError, match="CUDA"):
        device.resolve_device_type("cuda")
    with pytest.raises(ValueError, match="unknown device"):
        device.resolve_device_type("gpu")
    assert device.accelerator_module("cpu") is None


def test_npu_resolution_with_torch_npu(fake_torch_npu):
    npu, _ = fake_torch_npu
    assert device.resolve_device_type("auto") == "npu"
    assert device.resolve_device_type("npu") == "npu"
    assert device.accelerator_module("npu") is npu


def test_accelerator_snapshot_uses_side_stream_and_event(fake_torch_npu):
    npu, compute = fake_torch_npu
    stager = DoubleBufferStager("npu", pin_memory=False)  # no pinned allocator on a CPU-only build
    state = {"w": torch.randn(64, 64), "step": 3}
    expected = state["w"].clone()
    future = stager.stage(state)
    side = stager._stream
    assert side.waited_streams == [compute]  # copies ordered after the compute stream
    stager.wait_snapshot()  # accelerator: the compute stream waits on the event; the host does not
    assert compute.waited_events and compute.waited_events[0].recorded_on is side
    staged = future.result()
    assert torch.equal(staged["w"], expected) and staged["step"] == 3
    stager.close()


def test_a_device_side_wait_still_leaves_a_host_wait_for_close(fake_torch_npu):
    """before_step on an accelerator only orders the compute stream; close() must still wait on
    the host for the copy before it frees the pinned buffers."""
    npu, compute = fake_torch_npu
    stager = DoubleBufferStager("npu", pin_memory=False)
    stager.stage({"w": torch.randn(16, 16)})
    stager.wait_snapshot()
    stager.wait_snapshot()  # ordered once, not once per call
    assert len(compute.waited_events) == 1
    assert stager._pending is not None  # the host has not waited yet
    stager.close()
    assert stager._pending is None and stager.host_bytes == 0

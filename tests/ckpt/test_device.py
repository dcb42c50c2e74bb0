"""Device/backend resolution, with torch_npu imported lazily, and the accelerator staging path
driven through a stand-in accelerator module (this machine has neither NPU nor GPU): which device
the side stream and the copier thread use, how long sources live, where host sources are copied,
how the compute stream's wait is timed. Where a real accelerator is present, the CPU-only
assertions are skipped and tests/ckpt/test_accelerator.py runs the real thing."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ckpt import device
from tests.support import stand_in_npu as stand_in
from tests.support.stand_in_npu import SOURCE_DEVICE, Event, StandInCopy, StandInStager

REAL_ACCELERATOR = torch.cuda.is_available() or device.npu_available()


@pytest.fixture
def fake_torch_npu(monkeypatch):
    return stand_in.install(monkeypatch)


def test_backends():
    assert [device.backend_for(d) for d in ("npu", "cuda", "cpu")] == ["hccl", "nccl", "gloo"]
    assert device.process_group_backend("npu") == "cpu:gloo,npu:hccl"
    assert device.process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert device.process_group_backend("cpu") == "gloo"
    with pytest.raises(ValueError):
        device.backend_for("tpu")


@pytest.mark.skipif(REAL_ACCELERATOR, reason="CPU-only host: with a GPU or NPU 'auto' resolves to it "
                                              "(and torch >= 2.5 imports torch_npu itself)")
def test_cpu_resolution_without_accelerators():
    assert "torch_npu" not in sys.modules  # nothing imported it eagerly
    assert device.resolve_device_type("auto") == "cpu"
    with pytest.raises(device.DeviceUnavailableError, match="torch_npu"):
        device.resolve_device_type("npu")
    with pytest.raises(device.DeviceUnavailableError, match="CUDA"):
        device.resolve_device_type("cuda")


def test_resolution_everywhere():
    assert device.resolve_device_type("cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown device"):
        device.resolve_device_type("gpu")
    assert device.accelerator_module("cpu") is None
    device.empty_host_cache()  # with or without an accelerator: never "Cannot access accelerator device"


def test_npu_resolution_with_torch_npu(fake_torch_npu):
    npu, _ = fake_torch_npu
    assert device.resolve_device_type("npu") == "npu"
    assert device.accelerator_module("npu") is npu
    if not torch.cuda.is_available():
        assert device.resolve_device_type("auto") == "npu"


def test_accelerator_snapshot_uses_a_side_stream_of_the_sources_device(fake_torch_npu):
    npu, current_stream = fake_torch_npu
    stager = StandInStager("npu", pin_memory=False)  # no pinned allocator on a CPU-only build
    assert not [e for e in Event.created] and not stager._copy._streams  # nothing made before first use
    state = {"w": torch.randn(64, 64), "step": 3}
    expected = state["w"].clone()
    future = stager.stage(state)
    (side,) = stager._copy._streams.values()
    assert side.device == SOURCE_DEVICE  # not the current device (0)
    assert side.waited_streams == [current_stream(SOURCE_DEVICE)]  # ordered after that device's compute
    copy_event = next(e for e in Event.created if e.recorded_on is side)
    assert copy_event.blocking  # the copier thread sleeps on it instead of spinning a core
    stager.wait_snapshot()  # accelerator: the compute stream waits on the event; the host does not
    assert current_stream(SOURCE_DEVICE).waited_events == [copy_event]
    staged = future.result()
    assert torch.equal(staged["w"], expected) and staged["step"] == 3
    stager.close()


def test_the_copier_thread_is_bound_to_the_sources_device(fake_torch_npu):
    npu, _ = fake_torch_npu
    stager = StandInStager("npu", pin_memory=False)
    stager.stage({"w": torch.randn(8)}).result()
    assert npu.bound and all(name.startswith("ckpt-snapshot") for name, _ in npu.bound)
    assert {d for _, d in npu.bound} == {SOURCE_DEVICE}
    stager.close()


def test_the_copier_thread_waits_on_each_copy_bound_to_its_device(fake_torch_npu):
    """A host-only snapshot first (the thread starts with no device), then sources on npu:1, npu:2
    and npu:1 again: each copy event is waited for by a thread bound to the event's own device."""
    npu, _ = fake_torch_npu
    stager = StandInStager("npu", pin_memory=False)
    host = torch.randn(8)
    StandInCopy.host_pointers = {host.data_ptr()}
    stager.stage({"w": host}).result()
    devices = ["npu:1", "npu:2", "npu:1"]
    for source_device in devices:
        StandInCopy.device = source_device
        stager.stage({"w": torch.randn(8)}).result()
    copies = [e for e in Event.created if e.blocking]
    assert [e.recorded_on.device for e in copies] == devices
    assert [e.synchronized_bound_to for e in copies] == devices
    assert all(name.startswith("ckpt-snapshot") for name, _ in npu.bound)
    stager.close()


def test_a_temporary_source_lives_until_its_copy_is_complete(fake_torch_npu):
    """A tensor made by state_dict() (only the snapshot refers to it) must not be freed while the
    side stream still reads it: the caching allocator would hand its memory to the next forward."""
    gate = threading.Event()
    original = Event.__init__

    def gated(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.gate = gate

    stager = StandInStager("npu", pin_memory=False)
    temporary = torch.randn(32) * 2
    storage = StorageWeakRef(temporary.untyped_storage())  # a C++ weak reference: no Python wrapper games
    Event.__init__ = gated
    try:
        future = stager.stage({"w": temporary})
    finally:
        Event.__init__ = original
    del temporary
    assert not storage.expired(), "the source was freed while its copy was still in flight"
    gate.set()
    future.result()
    stager.wait_snapshot(host=True)
    assert storage.expired()  # and it does not leak once the copy is done
    stager.close()


class _Spy(torch.Tensor):
    """Records the thread of every copy that reads it."""

    readers: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_":
            cls.readers.append(threading.current_thread().name)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_host_sources_are_copied_off_the_training_thread_and_waited_for_on_the_host(fake_torch_npu):
    """CPU-offloaded parameters and optimizer state beside device tensors: their copy must not run
    inside save() (a full host memcpy on the training thread), and the host must wait for it before
    the optimizer (which runs on the host) changes them."""
    _Spy.readers = []
    offloaded = torch.randn(256, 256).as_subclass(_Spy)
    on_device = torch.randn(16)
    StandInCopy.host_pointers = {offloaded.data_ptr()}
    stager = StandInStager("npu", pin_memory=False)
    future = stager.stage({"offloaded": offloaded, "w": on_device})
    stager.wait_snapshot()  # the host part is done after this, without a host=True wait
    assert stager._copy._host_part is None
    assert _Spy.readers and all(name.startswith("ckpt-snapshot") for name in _Spy.readers), _Spy.readers
    staged = future.result()
    assert torch.equal(staged["offloaded"].as_subclass(torch.Tensor), offloaded.as_subclass(torch.Tensor))
    stager.close()


def test_the_compute_streams_wait_is_timed(fake_torch_npu):
    stager = StandInStager("npu", pin_memory=False)
    stager.stage({"w": torch.randn(16, 16)})
    assert stager.device_stall_s == 0.0
    stager.wait_snapshot()
    assert stager.device_stall_s == pytest.approx(0.005)  # the stand-in's 5 ms between the timing events
    timing = [e for e in Event.created if e.enable_timing]
    assert len(timing) == 2 and all(e.recorded_on.name == "compute" for e in timing)
    stager.close()


def test_a_device_side_wait_still_leaves_a_host_wait_for_close(fake_torch_npu):
    """before_step on an accelerator only orders the compute stream; close() must still wait on
    the host for the copy before it frees the pinned buffers."""
    _, current_stream = fake_torch_npu
    stager = StandInStager("npu", pin_memory=False)
    stager.stage({"w": torch.randn(16, 16)})
    stager.wait_snapshot()
    stager.wait_snapshot()  # ordered once, not once per call
    assert len(current_stream(SOURCE_DEVICE).waited_events) == 1
    assert stager._copy.pending  # the host has not waited yet
    stager.close()
    assert not stager._copy.pending and stager.host_bytes == 0

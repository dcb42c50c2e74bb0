"""A stand-in ``torch.npu`` for driving the accelerator staging path on a CPU-only machine.

``install(monkeypatch)`` registers a fake ``torch_npu`` module and ``torch.npu`` (streams, events,
``set_device`` per thread, ``host_empty_cache``) and returns it. ``StandInStager`` copies through
``StandInCopy``, which treats every source as living on ``SOURCE_DEVICE`` (or on ``StandInCopy.device``
when a test moves it), except the data pointers registered in ``StandInCopy.host_pointers``.
``PinnedStandIn`` serves ``torch.empty(pin_memory=True)`` as torch_npu's host allocator would on a
build that has none: host memory, every block watched, so a test sees the bytes still held."""

from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ckpt import DoubleBufferStager

SOURCE_DEVICE = "npu:1"  # where the stand-in's "device" sources live; the current device stays 0


class Event:
    created: list["Event"] = []

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing, self.blocking = enable_timing, blocking
        self.recorded_on = None
        self.synchronized = False
        self.synchronized_bound_to = None  # the device the waiting thread was bound to
        self.gate = None  # a threading.Event that synchronize() waits on, when set by a test
        Event.created.append(self)

    def record(self, stream=None):
        self.recorded_on = stream

    def synchronize(self):
        if self.gate is not None:
            assert self.gate.wait(30), "the test never released the copy"
        self.synchronized_bound_to = torch.npu.bound_now.get(threading.current_thread().name)
        self.synchronized = True

    def query(self):
        return True

    def elapsed_time(self, other):
        return 5.0  # ms, as a compute stream's wait for the copy


class Stream:
    def __init__(self, device=None, priority=0, name="side"):
        self.device, self.name, self.waited_streams, self.waited_events = device, name, [], []

    def wait_stream(self, other):
        self.waited_streams.append(other)

    def wait_event(self, event):
        self.waited_events.append(event)


def fake_npu():
    """The stand-in module and its ``current_stream``."""
    computes: dict = {}

    def current_stream(device=None):
        return computes.setdefault(device, Stream(device, name="compute"))

    bound: list[tuple[str, object]] = []  # (thread name, device) per set_device call
    bound_now: dict[str, object] = {}  # thread name -> its current device
    emptied: list[tuple[str, int]] = []  # (thread name, pinned bytes still held) per host_empty_cache

    def set_device(device):
        bound.append((threading.current_thread().name, device))
        bound_now[threading.current_thread().name] = device

    module = types.SimpleNamespace(
        is_available=lambda: True, Stream=Stream, Event=Event, current_stream=current_stream,
        stream=lambda s: contextlib.nullcontext(), device_count=lambda: 8, current_device=lambda: 0,
        set_device=set_device, bound=bound, bound_now=bound_now, emptied=emptied,
        __name__="torch.npu",
    )
    return module, current_stream


class StandInCopy(DoubleBufferStager.copy_engine):
    """Treats every source as living on ``device``, except those registered as host memory."""

    host_pointers: set[int] = set()
    device = SOURCE_DEVICE

    def device_of(self, tensor):
        return None if tensor.data_ptr() in self.host_pointers else StandInCopy.device


class StandInStager(DoubleBufferStager):
    copy_engine = StandInCopy


class PinnedStandIn:
    """``torch.empty(..., pin_memory=True)`` served from host memory, each block's storage watched."""

    def __init__(self, monkeypatch):
        self.requests: list[int] = []  # bytes of every pinned allocation, in order
        self.blocks: list[tuple[StorageWeakRef, int]] = []
        self.live_at_request: list[int] = []  # pinned bytes still held when each allocation was asked
        empty = torch.empty

        def pinned_empty(*args, pin_memory=False, **kwargs):
            if not pin_memory:
                return empty(*args, **kwargs)
            self.live_at_request.append(self.live_bytes())
            block = empty(*args, **kwargs)
            self.requests.append(block.nbytes)
            self.blocks.append((StorageWeakRef(block.untyped_storage()), block.nbytes))
            return block

        monkeypatch.setattr(torch, "empty", pinned_empty)

    def live_bytes(self) -> int:
        """Pinned bytes some reference still holds (the allocator cannot give them back)."""
        return sum(n for ref, n in self.blocks if not ref.expired())


def install(monkeypatch, pinned: PinnedStandIn | None = None):
    """Register the stand-in ``torch_npu``; returns ``(torch.npu, current_stream)``."""
    npu, current_stream = fake_npu()
    if pinned is not None:
        npu.host_empty_cache = lambda: npu.emptied.append((threading.current_thread().name, pinned.live_bytes()))
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    Event.created.clear()
    StandInCopy.host_pointers = set()
    monkeypatch.setattr(StandInCopy, "device", SOURCE_DEVICE)
    return npu, current_stream

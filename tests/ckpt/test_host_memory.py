"""Where the stager's host buffers come from and how they go back, driven through the stand-in
``torch.npu`` (tests/support/stand_in_npu.py; this machine has no NPU and no pinned allocator):
torch_npu's host allocator serves the pinned segments, every reference to a set is dropped before
its blocks are reused or given back, nothing is given back on the training thread inside
``stage()``, and ``close()`` gives the cached blocks back once nothing holds them."""

from __future__ import annotations

import importlib.util
import threading
from concurrent.futures import Future

import pytest
import torch

from ckpt import device
from tests.support import stand_in_npu as stand_in
from tests.support.stand_in_npu import StandInStager



@pytest.fixture
def pinned_npu(monkeypatch):
    """The stand-in torch_npu, with ``torch.empty(pin_memory=True)`` served and watched."""
    pinned = stand_in.PinnedStandIn(monkeypatch)
    npu, _ = stand_in.install(monkeypatch, pinned)
    return npu, pinned


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_pinned_memory_for_npu_needs_torch_npu():
    with pytest.raises(device.DeviceUnavailableError, match="torch_npu"):
        device.host_memory("npu", pin=True)
    assert not device.host_memory("npu", pin=False).pinned
    assert not device.host_memory("cpu", pin=True).pinned  # nothing to pin for


def test_npu_buffers_come_from_torch_npus_host_allocator_and_go_back_through_it(pinned_npu):
    npu, pinned = pinned_npu
    stager = StandInStager("npu")  # pinned: the default on an accelerator
    assert (stager.host_memory.device_type, stager.host_memory.pinned) == ("npu", True)
    state = {"a": torch.randn(1000), "b": torch.randn(33, 7)}
    staged = stager.stage(state).result()
    assert pinned.requests == [8192]  # one power-of-two segment (4992 bytes packed), asked pinned
    assert torch.equal(staged["a"], state["a"]) and torch.equal(staged["b"], state["b"])
    del staged
    stager.close()
    assert npu.emptied == [(threading.current_thread().name, 0)]  # torch.npu.host_empty_cache, nothing held


def test_close_drops_every_reference_before_it_gives_the_blocks_back(pinned_npu):
    npu, pinned = pinned_npu
    stager = StandInStager("npu")
    state = {"w": torch.randn(64)}
    for _ in range(3):  # untracked: the third snapshot reuses the first set
        stager.stage(state).result()
    stager.wait_snapshot()  # on the device path the host has not waited: the last result is still held
    assert pinned.requests == [256, 256] and pinned.live_bytes() == 512
    stager.close()
    assert pinned.live_bytes() == 0 and stager.host_bytes == 0
    assert npu.emptied == [(threading.current_thread().name, 0)]  # given back once, when nothing held a block


def test_a_layout_change_drops_the_old_sets_before_it_allocates_and_gives_nothing_back(pinned_npu):
    """Both sets hold the old layout and are free, the last snapshot's result is still referenced
    (device path, no host wait): all of it must go before the new set is asked for, so that the
    allocator reuses the blocks, and no block is handed to the system inside stage()."""
    npu, pinned = pinned_npu
    stager = StandInStager("npu")
    writes = [Future(), Future()]
    for write in writes:  # each set busy until its write ends: two sets of the old layout
        stager.stage({"w": torch.randn(64)}, release=write).result()
    for write in writes:
        write.set_result(None)
    assert pinned.live_bytes() == 2 * 256
    state = {"w": torch.randn(64), "v": torch.randn(10)}
    staged = stager.stage(state).result()
    assert pinned.live_at_request == [0, 256, 0]  # the third request: nothing of the old layout held
    assert pinned.live_bytes() == stager.host_bytes == 512  # 296 bytes packed
    assert npu.emptied == []  # no cudaFreeHost/aclrtFreeHost on the training thread inside stage()
    assert torch.equal(staged["w"], state["w"]) and torch.equal(staged["v"], state["v"])
    del staged
    stager.close()
    assert npu.emptied == [(threading.current_thread().name, 0)]

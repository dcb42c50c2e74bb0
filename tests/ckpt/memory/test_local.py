"""ckpt.memory.local: a rank's own checkpoint of the memory tier (flat_local's walk)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ckpt.memory.local import flat_local


@pytest.fixture
def mesh():
    """A 2-rank mesh over torch's fake process group (in process: DTensors without peers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_a_dtensor_is_kept_as_its_local_tensor_itself(mesh):
    """The rank's shard itself (same object, no view made through autograd), even where the tree's
    DTensors require grad and the writer thread has grad mode on, as a new thread does."""
    live = DTensor.from_local(torch.randn(6, 4), mesh, [Shard(0)], run_check=False).requires_grad_()
    assert torch.is_grad_enabled()
    flat, paths = flat_local({"model": {"w": live}, "step": 3})
    assert flat["model.w"] is live._local_tensor and flat["step"] == 3
    assert paths == {"model.w": ("model", "w"), "step": ("step",)}

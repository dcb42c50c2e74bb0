"""trainer.device.init_distributed: the rank's device is selected before the process group starts
and bound to it (``device_id``), so NCCL/HCCL never open a context on another rank's device."""

from __future__ import annotations

import types

import torch

from trainer import device as trainer_device


def test_the_device_is_set_before_the_group_starts_and_bound_to_it(monkeypatch):
    calls = []
    accel = types.SimpleNamespace(set_device=lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(trainer_device, "accelerator_module", lambda device_type: accel)
    monkeypatch.setattr(trainer_device.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer_device.dist, "init_process_group",
                        lambda **kwargs: calls.append(("init_process_group", kwargs)))
    monkeypatch.setattr(trainer_device.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(trainer_device.dist, "get_world_size", lambda: 8)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    rank, world, device, started = trainer_device.init_distributed("cuda")
    assert (rank, world, device, started) == (3, 8, torch.device("cuda", 3), True)
    assert calls[0] == ("set_device", 3)
    assert calls[1] == ("init_process_group", {"backend": "cpu:gloo,cuda:nccl", "device_id": torch.device("cuda", 3)})


def test_cpu_groups_are_not_bound_to_a_device(monkeypatch):
    kwargs_seen = []
    monkeypatch.setattr(trainer_device.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer_device.dist, "init_process_group", lambda **kwargs: kwargs_seen.append(kwargs))
    monkeypatch.setattr(trainer_device.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(trainer_device.dist, "get_world_size", lambda: 1)
    monkeypatch.delenv("RANK", raising=False)
    assert trainer_device.init_distributed("cpu")[2] == torch.device("cpu")
    assert "device_id" not in kwargs_seen[0] and kwargs_seen[0]["backend"] == "gloo"

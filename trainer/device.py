"""The trainer's device layer: resolution (from ckpt.device, shared with the engine), process
group start-up, and the few accelerator calls the loop needs (memory, synchronisation)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from ckpt.device import (  # re-exported: one module for device questions
    BACKENDS,
    DeviceUnavailableError,
    accelerator_module,
    backend_for,
    process_group_backend,
    resolve_device_type,
)

__all__ = [
    "BACKENDS", "DeviceUnavailableError", "accelerator_module", "backend_for", "process_group_backend",
    "resolve_device_type", "init_distributed", "device_name", "peak_memory_gib", "synchronize",
]


def init_distributed(device_type: str) -> tuple[int, int, torch.device, bool]:
    """Start the default process group (``torchrun`` env vars, or a 1-rank group for a plain
    ``python -m``) unless one exists; return ``(rank, world_size, device, started)`` with this
    rank's device selected (``started``: this call created the group).

    The device is selected *before* the group starts and handed to it as ``device_id``: NCCL/HCCL
    then bind this rank's communicator to its own device (no context opened on device 0 by ranks
    that are not 0, no guess from the rank), and barriers use that device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    accel = accelerator_module(device_type)
    device = torch.device("cpu") if accel is None else torch.device(device_type, local_rank)
    if accel is not None:
        accel.set_device(local_rank)
    started = not dist.is_initialized()
    if started:
        backend = process_group_backend(device_type)
        bound = {} if accel is None else {"device_id": device}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, **bound)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    **bound)
    return dist.get_rank(), dist.get_world_size(), device, started


def device_name(device_type: str) -> str:
    accel = accelerator_module(device_type)
    if accel is None:
        return "cpu"
    return accel.get_device_name(accel.current_device())


def peak_memory_gib(device_type: str) -> float:
    """Peak accelerator memory allocated by this process, or peak resident set size on CPU."""
    accel = accelerator_module(device_type)
    if accel is not None:
        return accel.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def synchronize(device_type: str) -> None:
    accel = accelerator_module(device_type)
    if accel is not None:
        accel.synchronize()

"""Device and backend resolution shared by the engine and the trainer.

    npu  -> torch_npu (imported lazily, only when asked for or probing "auto") -> backend "hccl"
    cuda -> backend "nccl"
    cpu  -> backend "gloo"

``process_group_backend`` gives the mixed string (``"cpu:gloo,npu:hccl"``) that ``dcp.async_save``
needs, because DCP runs its CPU-side collectives on the same group. ``accelerator_module`` returns
``torch.npu`` / ``torch.cuda`` (streams, events, RNG, pinned memory) or None on CPU;
``host_memory`` says where a stager's host buffers come from (the device's pinned host allocator, or
plain memory) and ``empty_host_cache`` returns that allocator's cached, unused blocks to the system.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from .errors import DeviceUnavailableError

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def _load_torch_npu() -> bool:
    """Import torch_npu (which registers ``torch.npu``); False when it is not installed or unusable."""
    if hasattr(torch, "npu") and "torch_npu" in importlib.sys.modules:
        return True
    try:
        importlib.import_module("torch_npu")
    except Exception:  # ImportError, or CANN libraries missing at import time
        return False
    return hasattr(torch, "npu")


def npu_available() -> bool:
    return _load_torch_npu() and bool(torch.npu.is_available())


def resolve_device_type(requested: str = "auto") -> str:
    """Map "auto" | "npu" | "cuda" | "cpu" to a device type present here (auto prefers npu, then cuda)."""
    requested = requested.lower()
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"unknown device type {requested!r}; expected auto, npu, cuda or cpu")
    if requested == "auto":
        if npu_available():
            return "npu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "npu" and not npu_available():
        raise DeviceUnavailableError("device 'npu' requested but torch_npu is not installed or sees no NPU")
    if requested == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailableError("device 'cuda' requested but CUDA is not available")
    return requested


def backend_for(device_type: str) -> str:
    try:
        return BACKENDS[device_type]
    except KeyError:
        raise ValueError(f"unknown device type {device_type!r}") from None


def process_group_backend(device_type: str) -> str:
    """Backend string for ``init_process_group``: gloo alone on CPU, else CPU gloo beside the accelerator's."""
    backend = backend_for(device_type)
    return backend if device_type == "cpu" else f"cpu:gloo,{device_type}:{backend}"


def accelerator_module(device_type: str | None = None) -> ModuleType | None:
    """``torch.npu`` or ``torch.cuda`` for the given (or auto-detected) accelerator; None for CPU."""
    if device_type is None:
        device_type = "npu" if ("torch_npu" in importlib.sys.modules and npu_available()) else (
            "cuda" if torch.cuda.is_available() else "cpu"
        )
    if device_type == "cpu":
        return None
    if device_type == "npu":
        if not _load_torch_npu():
            raise DeviceUnavailableError("torch_npu is not installed")
        return torch.npu
    return torch.cuda


class HostMemory:
    """Host memory for snapshots of one device type: pinned by that device's caching host allocator, or plain.

    ``empty(nbytes)`` allocates; freeing a pinned block (its last reference dropped) only returns it to the
    allocator's cache, where a later ``empty`` of the same power-of-two size reuses it; ``give_back()``
    hands the cached, unused blocks to the system (``cudaFreeHost`` / ``aclrtFreeHost``: slow, and it may
    synchronize the device, so a caller keeps it off the training thread's hot path)."""

    def __init__(self, device_type: str, pinned: bool):
        self.device_type, self.pinned = device_type, pinned

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give_back(self) -> None:
        if self.pinned:
            empty_host_cache(self.device_type)


def host_memory(device_type: str, pin: bool) -> HostMemory:
    """Where host buffers for ``device_type`` come from (``pin``: pinned, when the device has pinned memory).

    torch pins (``pin_memory=True``) with the host allocator of the accelerator in use. On npu that is
    torch_npu's NPU caching host allocator (``aclrtMallocHost``): torch_npu registers it for its device
    and pins this way in its own tests, so torch_npu is imported before the first allocation (without it,
    torch has no accelerator to pin for). Registering our own memory with the runtime
    (``torch.npu.npurt().npuHostRegister``) is not used: memory from that allocator is pinned already."""
    pinned = pin and device_type != "cpu"
    if pinned and device_type == "npu" and not _load_torch_npu():
        raise DeviceUnavailableError("pinned host memory for npu needs torch_npu, which is not installed")
    return HostMemory(device_type, pinned)


def empty_host_cache(device_type: str | None = None) -> None:
    """Hand the accelerator's cached, unused pinned host blocks back to the system (no-op on CPU).

    npu (asked for, or torch_npu imported): torch_npu's own ``torch.npu.host_empty_cache`` — torch's
    generic call reaches torch_npu's allocator only in builds where torch_npu registers it as torch's
    host allocator. Otherwise ``torch.accelerator.empty_host_cache`` where torch has it; on older CUDA
    builds the CUDA host allocator's own call."""
    if device_type == "cpu":
        return
    npu = device_type == "npu" or (device_type is None and "torch_npu" in importlib.sys.modules)
    if npu and _load_torch_npu() and hasattr(torch.npu, "host_empty_cache"):
        torch.npu.host_empty_cache()
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "empty_host_cache"):
        if accelerator.is_available():
            accelerator.empty_host_cache()
    elif torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()

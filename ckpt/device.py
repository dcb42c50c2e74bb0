"""Device and backend resolution shared by the engine and the trainer.

    npu  -> torch_npu (imported lazily, only when asked for or probing "auto") -> backend "hccl"
    cuda -> backend "nccl"
    cpu  -> backend "gloo"

``process_group_backend`` gives the mixed string (``"cpu:gloo,npu:hccl"``) that ``dcp.async_save``
needs, because DCP runs its CPU-side collectives on the same group. ``accelerator_module`` returns
``torch.npu`` / ``torch.cuda`` (streams, events, RNG, pinned memory) or None on CPU;
``empty_host_cache`` returns cached pinned host blocks to the system.
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


def empty_host_cache() -> None:
    """Hand the accelerator's cached, unused pinned host blocks back to the system (no-op on CPU).

    ``torch.accelerator.empty_host_cache`` where torch has it (it serves torch_npu too); on older
    CUDA builds the CUDA host allocator's own call."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "empty_host_cache"):
        if accelerator.is_available():
            accelerator.empty_host_cache()
    elif torch.cuda.is_available() and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()

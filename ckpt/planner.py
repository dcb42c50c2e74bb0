"""A load planner that is safe with any reader and checks the checkpoint against the live state.

DCP's default planner unpickles non-tensor values with ``torch.load(weights_only=False)`` and only
notices mismatches one at a time. :class:`SafeLoadPlanner` takes decoded objects directly from our
reader (``load_value``), reads any foreign byte stream with ``weights_only=True``, and before a
single byte is read raises one :class:`~ckpt.errors.IncompatibleCheckpointError` that lists every
missing and unexpected key and every shape, dtype or kind mismatch.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from .errors import IncompatibleCheckpointError, UnsafeCheckpointError

try:  # private in torch; only used to put values back where they came from
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # pragma: no cover - moved in some future torch
    set_element = None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` plus strict compatibility checking and pickle-free values.

    Args:
        strict: when False, keys missing from the checkpoint keep their current values and keys
            only in the checkpoint are ignored; shape, dtype and kind mismatches always fail.
    """

    def __init__(self, strict: bool = True):
        super().__init__(allow_partial_load=not strict)
        self.strict = strict

    def create_local_plan(self) -> LoadPlan:
        self._check_compatible()
        return super().create_local_plan()

    def _check_compatible(self) -> None:
        saved = self.metadata.state_dict_metadata
        live = self.state_dict
        missing = [k for k in live if k not in saved]
        unexpected = [k for k in saved if k not in live]
        mismatched = []
        for key in live.keys() & saved.keys():
            problem = _mismatch(saved[key], live[key])
            if problem:
                mismatched.append((key, *problem))
        if mismatched or (self.strict and (missing or unexpected)):
            raise IncompatibleCheckpointError(
                missing if self.strict else [], unexpected if self.strict else [], mismatched
            )

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Put a decoded non-tensor value where its key came from in the caller's state."""
        key = read_item.dest_index.fqn
        if self.flatten_state_dict and set_element is not None:
            set_element(self.original_state_dict, self.mappings[key], value)
        else:
            self.state_dict[key] = value

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpointError(
                f"value {read_item.dest_index.fqn!r} needs code execution to load ({type(exc).__name__}); refused"
            ) from None
        self.load_value(read_item, obj)


def _describe_tensor(shape, dtype) -> str:
    return f"tensor {list(shape)} {str(dtype).removeprefix('torch.')}"


def _mismatch(saved, live) -> tuple[str, str] | None:
    live_is_tensor = isinstance(live, (torch.Tensor, DTensor))
    if isinstance(saved, TensorStorageMetadata):
        saved_desc = _describe_tensor(saved.size, saved.properties.dtype)
        if not live_is_tensor:
            return saved_desc, f"a {type(live).__name__} value"
        if tuple(saved.size) != tuple(live.shape) or saved.properties.dtype != live.dtype:
            return saved_desc, _describe_tensor(live.shape, live.dtype)
        return None
    if live_is_tensor:
        return "a non-tensor value", _describe_tensor(live.shape, live.dtype)
    return None

"""A load planner that is safe with any reader and checks the checkpoint against the live state.

DCP's default planner unpickles non-tensor values with ``torch.load(weights_only=False)`` and only
notices mismatches one at a time. :class:`SafeLoadPlanner` takes decoded objects directly from our
reader (``load_value``), reads any foreign byte stream with ``weights_only=True``, and before a
single byte is read raises one :class:`~ckpt.errors.IncompatibleCheckpointError` that lists every
missing and unexpected key and every shape, dtype or kind mismatch.

The check is global, made by DCP's coordinator over every rank's local report: a key is
*unexpected* only when no rank asks for it. State a rank saved for itself alone (torchtitan's
``dataloader.dp_rank_<r>``, a per-rank RNG under a rank-named key) therefore loads strictly on the
same ranks, while a key nobody asks for (a removed module, a rank that no longer exists) is still
refused. *Missing* and *mismatched* are per rank: each rank's live keys must be in the checkpoint
with a fitting shape, dtype and kind. Without a process group the one rank is the whole world.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from .gc_pause import paused_gc
from .local_plan import local_load_plan
from .rollback import Rollback
from ..errors import IncompatibleCheckpointError, UnsafeCheckpointError

try:  # private in torch; only used to put values back where they came from
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # pragma: no cover - moved in some future torch
    set_element = None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` plus strict compatibility checking and pickle-free values.

    Args:
        strict: when True (the default) every live key must be in the checkpoint and every saved key
            must be asked for by some rank; when False, keys missing from the checkpoint keep their
            current values and keys only in the checkpoint are ignored. Shape, dtype and kind
            mismatches always fail.
        rollback: a :class:`~ckpt.read.rollback.Rollback` to keep each live region in before it is
            first written (``ckpt.load`` puts them back when the load fails).
    """

    def __init__(self, strict: bool = True, rollback: Rollback | None = None):
        super().__init__(allow_partial_load=not strict)
        self.strict = strict
        self.rollback = rollback  # given: every region is copied there before the load writes it
        self.plan_checks = 0  # overlap tests of local against saved chunks in the last local plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The live region ``read_item`` fills (every read path writes only what this returned),
        kept by ``rollback`` before its first byte changes."""
        region = super().resolve_tensor(read_item)
        if self.rollback is not None:
            index = read_item.dest_index
            self.rollback.keep((index.fqn, tuple(index.offset or ()), tuple(read_item.dest_offsets),
                                tuple(read_item.lengths)), region)
        return region

    def create_local_plan(self) -> LoadPlan:
        report = self._local_report()
        if report.mismatched or (self.strict and report.missing):
            return LoadPlan([], planner_data=report)  # the coordinator raises, for every rank at once
        plan = self._indexed_local_plan()
        return LoadPlan(plan.items, plan.storage_data, report)

    def _indexed_local_plan(self) -> LoadPlan:
        """DCP's local plan, its saved chunks indexed (:mod:`ckpt.read.local_plan`); ``plan_checks``: the
        overlap tests it made. DCP's own key fallback for pre-2.4 flattened checkpoints is kept."""
        if self.flatten_state_dict:
            missing = self.metadata.state_dict_metadata.keys() - self.state_dict.keys()
            if missing:
                _version._derived_version = "2_3"
                old_state_dict, old_mappings = flatten_state_dict(self.original_state_dict)
                if old_state_dict.keys() & missing:
                    self.state_dict, self.mappings = old_state_dict, old_mappings
                _version._derived_version = None
        with paused_gc():
            plan, self.plan_checks = local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        return plan

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        reports = [plan.planner_data for plan in global_plan if isinstance(plan.planner_data, _FitReport)]
        missing = sorted({key for r in reports for key in r.missing})
        mismatched = sorted({problem for r in reports for problem in r.mismatched})
        # unexpected: saved keys no rank asks for (each rank reports the saved keys it asks for: a
        # report as long as the rank's own state, never as long as every rank's rank-local keys)
        asked = set().union(*(r.asked for r in reports))
        unexpected = sorted(self.metadata.state_dict_metadata.keys() - asked) if reports and self.strict else []
        if mismatched or (self.strict and (missing or unexpected)):
            raise IncompatibleCheckpointError(
                missing if self.strict else [], unexpected if self.strict else [], mismatched
            )
        global_plan = [LoadPlan(p.items, p.storage_data) for p in global_plan]
        return super().create_global_plan(global_plan)

    def _local_report(self) -> "_FitReport":
        saved = self.metadata.state_dict_metadata
        live = self.state_dict
        mismatched = []
        for key in live.keys() & saved.keys():
            problem = _mismatch(saved[key], live[key])
            if problem:
                mismatched.append((key, *problem))
        asked = [k for k in live if k in saved] if self.strict else []  # only strict mode needs them
        return _FitReport(missing=[k for k in live if k not in saved], asked=asked, mismatched=mismatched)

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


@dataclass
class _FitReport:
    """One rank's view of how the checkpoint fits its state, sent to the coordinator in its plan."""

    missing: list[str] = field(default_factory=list)  # live keys the checkpoint lacks
    asked: list[str] = field(default_factory=list)  # saved keys this rank asks for (strict mode)
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)


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

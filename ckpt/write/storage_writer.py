"""DCP's StorageWriter in our format: the protocol object of a save.

    dcp.save(state_dict, storage_writer=ckpt.dcp.Writer(path))

The coordinator begins the commit attempt (:mod:`ckpt.commit`) in ``prepare_global_plan`` and tells
each rank where to write; each rank writes its data files (:mod:`ckpt.write.files`: encode,
balance, data files); the coordinator builds the manifest (:mod:`ckpt.write.assemble`) and
commits it in ``finish`` — the manifest last, so a partial save is never visible.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import commit
from ..errors import InvalidOptionError
from ..format import Manifest
from ..options import SaveOptions
from ..storage import Location, locate
from .assemble import build_manifest
from .delta import DeltaBase
from .files import write_rank


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future



@dataclass(frozen=True)
class _RankTarget:
    """What the coordinator tells each rank in its plan: where to write (a path on the writer's own
    mount: no storage options travel between ranks), the attempt's tag and the rank id."""

    directory: str
    tag: str
    rank: int


class Writer(StorageWriter):
    """Writes a checkpoint directory in our format; commits it atomically on ``finish``.

    Args:
        path: the checkpoint directory to create, a path or a URL such as ``s3://bucket/run/step-1``
            (``dcp.save(checkpoint_id=...)`` may set it instead), resolved here; a
            :class:`~ckpt.storage.Location` (the manager's) is used as it is.
        overwrite: replace an existing committed checkpoint at ``path`` (atomically) instead of failing.
        step: recorded in the manifest.
        base: a :class:`~ckpt.write.delta.DeltaBase`: the checkpoint is then a delta, each chunk stored
            against the same chunk of ``base.state`` (chunks without a match are stored whole),
            and ``base.name`` (a sibling of ``path``) is recorded as its base.
        kind: optional check, "full" or "delta"; must agree with ``base``.
        options: a :class:`~ckpt.options.SaveOptions`; the writer uses ``files_per_rank``,
            ``compress``, ``zstd_level``, ``encode_threads`` and ``user_metadata``. Those fields
            may also be given as keyword arguments (``Writer(path, files_per_rank=4)``).
        storage_options: passed to fsspec for a URL (credentials, ``client_kwargs``); never stored.
    """

    def __init__(
        self,
        path: str | os.PathLike | Location | None = None,
        *,
        overwrite: bool = False,
        step: int | None = None,
        base: DeltaBase | None = None,
        kind: str | None = None,
        options: SaveOptions | None = None,
        storage_options: dict | None = None,
        **option_overrides: Any,
    ):
        super().__init__()
        self.storage_options = storage_options
        self.options = (options or SaveOptions()).replace(**option_overrides)
        if kind is not None and (kind not in ("full", "delta") or (kind == "delta") != (base is not None)):
            raise InvalidOptionError("kind", kind, "must be 'delta' exactly when base=DeltaBase(...) is given")
        if base is not None and not isinstance(base, DeltaBase):
            raise TypeError(f"base must be a ckpt.delta.DeltaBase, not {type(base).__name__}")
        self.path = locate(path, self.storage_options) if path is not None else None
        if base is not None and (base.step == step or (self.path is not None and base.name == self.path.name)):
            raise InvalidOptionError("base", base.name, f"a delta cannot be its own base (step {base.step})")
        self.overwrite, self.step, self.base = overwrite, step, base
        self.attempt: commit.Attempt | None = None
        self.manifest: Manifest | None = None  # the committed manifest, on the coordinator
        self.before_begin = None  # a check the coordinator runs before anything is written (the manager's)
        self.before_commit = None  # the fence the coordinator runs right before the commit point (the manager's)
        self.run: str | None = None  # the run identity recorded in the manifest (the manager's)

    # -- DCP protocol ------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | Location | None = None) -> None:
        if checkpoint_id is not None:
            self.path = locate(checkpoint_id, self.storage_options)
        self.attempt = None
        self.manifest = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise ValueError("Writer needs a path (or dcp.save(checkpoint_id=...))")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.before_begin is not None:
            self.before_begin()
        self.attempt = commit.begin(self.path, overwrite=self.overwrite)
        return [
            dataclasses.replace(plan, storage_data=_RankTarget(self.attempt.directory.path, self.attempt.tag, rank))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        target: _RankTarget = plan.storage_data
        directory = Location(self.path.storage, target.directory)
        return _done(write_rank(directory, target.rank, plan.items, planner, self.options, self.base, target.tag))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        manifest = build_manifest(metadata, results, step=self.step, base=self.base, user=self.options.user_metadata,
                                  run=self.run)
        commit.finish(self.attempt, manifest, overwrite=self.overwrite, fence=self.before_commit)
        self.manifest = manifest

    def abort(self) -> None:
        """Remove what this save wrote after a failure (coordinator only; safe to call twice)."""
        if self.attempt is not None:
            commit.abort(self.attempt)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path))

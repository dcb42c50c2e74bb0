"""ckpt: a checkpoint storage engine for large-model training on top of torch.distributed.checkpoint.

    import ckpt
    ckpt.save({"model": model, "optim": optimizer, "step": 100}, "ckpts/step-00000100")
    ckpt.load({"model": model, "optim": optimizer, "step": 0}, "ckpts/step-00000100")
    ckpt.save(state, "s3://bucket/run/step-00000100")          # any fsspec URL (storage_options=...)

    with ckpt.CheckpointManager("ckpts", interval=100, keep=3,       # async, retained, replicated
                                replicas=["/mnt/shared/run1", "s3://bucket/run1"]) as manager:
        manager.attach(optimizer)
        ...
        manager.save(step, state)

DCP users plug in ``ckpt.dcp.Writer`` / ``ckpt.dcp.Reader`` instead. Every error is a
:class:`ckpt.CheckpointError`. The format is specified in docs/FORMAT.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    DeviceUnavailableError,
    ForeignRunError,
    IncompatibleCheckpointError,
    InvalidManifestError,
    InvalidOptionError,
    PeerLostError,
    SnapshotSkipped,
    StorageError,
    UnsafeCheckpointError,
    UnsupportedFormatError,
)
from .format import FORMAT_VERSION, Manifest
from .lazy import lazy_names
from .outcomes import CommitInfo, LoadStats, SaveStats
from .options import AsyncMode, BusyPolicy, Compression, FailurePolicy, SaveOptions

if TYPE_CHECKING:
    from . import dcp
    from .api import load, save
    from .manager import CheckpointManager
    from .read.committed import read_manifest
    from .read.planner import SafeLoadPlanner
    from .root import CheckpointRoot
    from .state import RNGState
    from .write.delta import DeltaBase
    from .write.staging import DoubleBufferStager

# imported on first use (ckpt.lazy): ``import ckpt`` pays for no DCP, DTensor or catalog
__getattr__, __dir__ = lazy_names(__name__, {
    "save": ".api", "load": ".api", "CheckpointManager": ".manager", "read_manifest": ".read.committed",
    "SafeLoadPlanner": ".read.planner", "CheckpointRoot": ".root", "RNGState": ".state",
    "DeltaBase": ".write.delta", "DoubleBufferStager": ".write.staging",
})

logging.getLogger(__name__).addHandler(logging.NullHandler())  # the application decides what is shown

__all__ = [
    "save", "load", "read_manifest", "dcp", "Manifest", "FORMAT_VERSION", "SafeLoadPlanner", "RNGState",
    "CheckpointManager", "CommitInfo", "LoadStats", "SaveStats", "SaveOptions", "AsyncMode", "BusyPolicy", "Compression", "FailurePolicy",
    "CheckpointRoot", "DeltaBase", "DoubleBufferStager",
    "CheckpointError", "CheckpointExistsError", "CheckpointLockedError", "CheckpointNotFoundError",
    "CheckpointWriteError", "CorruptCheckpointError", "DeviceUnavailableError", "ForeignRunError",
    "IncompatibleCheckpointError", "InvalidManifestError", "InvalidOptionError", "PeerLostError", "SnapshotSkipped", "StorageError", "UnsafeCheckpointError",
    "UnsupportedFormatError",
]

"""Plain DCP checkpoints (``FileSystemWriter``) that the import tests convert or damage: a small one
written by one process, a copy of a source to damage, and the check that a refused import left
nothing behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter


def save_small(path: Path) -> Path:
    """A single-process DCP checkpoint at ``path`` of a tensor and a few values (two data files)."""
    state = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(5, dtype=torch.bfloat16),
             "step": 1, "seen": {3, 1}}
    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=2), no_dist=True)
    return path


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def leaves_nothing(dst: Path) -> None:
    """A refused import left neither the target nor a temporary directory beside it."""
    assert not dst.exists()
    if dst.parent.exists():
        assert not [p.name for p in dst.parent.iterdir() if p.name.startswith(dst.name + ".")]

"""``ckpt.save`` / ``ckpt.load``: one call each, with or without torch.distributed.

Both run DCP with our :class:`~ckpt.dcp.Writer`/:class:`~ckpt.dcp.Reader` and
:class:`~ckpt.read.planner.SafeLoadPlanner`; every rank of the default (or given) process group calls
them collectively. Errors come out as :class:`~ckpt.errors.CheckpointError` subclasses, unwrapped
from DCP's per-rank ``CheckpointException``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .read.committed import read_manifest
from .dcp import Reader, Writer
from .errors import CheckpointError, CheckpointWriteError, IncompatibleCheckpointError
from .format import Manifest
from .outcomes import LoadStats
from .read.rollback import Rollback
from .read.planner import SafeLoadPlanner
from .state import export_state, stored_whole
from .storage import Location, locate

log = logging.getLogger(__name__)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process call; without a process group that is our normal case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def unwrap(exc: CheckpointException) -> BaseException:
    """The first of our errors inside DCP's per-rank wrapper (or the first failure at all)."""
    failures = [pair[0] for _, pair in sorted(exc.failures.items())]
    for failure in failures:
        if isinstance(failure, CheckpointError):
            return failure
    return failures[0] if failures else exc


def save(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    merged: bool = False,
    step: int | None = None,
    user_metadata: dict | None = None,
    files_per_rank: int = 1,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    storage_options: dict | None = None,
) -> None:
    """Save ``state`` as a sharded checkpoint directory at ``path`` (or, with ``merged=True``, as one
    consolidated ``.safetensors`` file gathered tensor by tensor).

    ``path`` is a directory or a URL (``s3://bucket/run/step-1``; ``storage_options`` go to fsspec).
    Collective across the ranks of ``process_group`` (default: the default group, when one is
    initialised); ``no_dist=True`` saves from this process alone."""
    if merged:
        from .convert.merged import save_merged

        save_merged(state, path, overwrite=overwrite, user_metadata=user_metadata, process_group=process_group,
                    no_dist=no_dist, storage_options=storage_options)
        return
    state_dict, _ = export_state(state)
    writer = Writer(path, overwrite=overwrite, step=step, files_per_rank=files_per_rank, user_metadata=user_metadata,
                    storage_options=storage_options)
    write_tree(state_dict, writer, process_group=process_group, no_dist=no_dist or not _distributed())


def write_tree(state_dict: dict, writer: Writer, *, process_group, no_dist: bool) -> None:
    """``dcp.save`` through our writer; on any failure remove its tmp dir and raise a CheckpointError."""
    try:
        with _quiet_single_process():
            dcp.save(state_dict, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    except CheckpointException as exc:
        _abort_quietly(writer)
        error = unwrap(exc)
        if isinstance(error, CheckpointError):
            raise error from None
        raise CheckpointWriteError(f"saving {writer.path} failed: {type(error).__name__}: {error}",
                                   path=str(writer.path)) from error
    except BaseException:
        _abort_quietly(writer)
        raise


def _abort_quietly(writer: Writer) -> None:
    """Remove what a failed save wrote; a failure of that clean-up (the mount is gone) is logged, never
    put in place of the save's own error. What is left is collected by the next save of the target."""
    try:
        writer.abort()
    except Exception as exc:
        log.warning("cleaning up after the failed save of %s failed too: %s: %s", writer.path, type(exc).__name__, exc)


def load(
    state: dict[str, Any],
    path: str | os.PathLike,
    *,
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    storage_options: dict | None = None,
    mirrors: tuple = (),
    stats: LoadStats | None = None,
    rollback: bool = True,
) -> Manifest:
    """Load the checkpoint at ``path`` into ``state`` in place, resharding to the current layout.

    Collective like :func:`save`; ``no_dist=True`` loads into this process alone (e.g. a plain
    model on one rank of a running job).

    Tensors are filled in place; modules, optimizers and stateful objects get ``load_state_dict``;
    plain values in dicts are replaced. ``mirrors``: other roots (replicas) a delta's base links may
    be read from when missing or damaged where ``path`` lies. ``stats``: a
    :class:`~ckpt.outcomes.LoadStats` to fill with what this rank moved (bytes read from storage;
    chunks several ranks need whole are read by one and sent to the others over the process
    group). Returns the checkpoint's manifest.

    A load that fails (on any rank) leaves ``state`` as it was: every tensor region it wrote is put
    back (``rollback``: a host copy of each region is kept until the load returns, up to the bytes
    this rank loads; ``rollback=False`` saves that memory for a caller that loads something else in
    full after a failure, and may then leave tensors partly loaded)."""
    path = locate(path, storage_options)  # resolved once, here: everything below takes the Location
    manifest = read_manifest(path)  # fails here, readably, before DCP wraps anything
    return load_with_manifest(state, path, manifest, strict=strict, process_group=process_group, no_dist=no_dist,
                              storage_options=storage_options, mirrors=mirrors, stats=stats, rollback=rollback)


def load_with_manifest(state: dict[str, Any], path: Location, manifest: Manifest, *, strict: bool = True,
                       process_group: dist.ProcessGroup | None = None, no_dist: bool = False,
                       storage_options: dict | None = None, mirrors: tuple = (),
                       stats: LoadStats | None = None, rollback: bool = False) -> Manifest:
    """:func:`load` of the checkpoint at ``path`` whose ``manifest`` the caller has just read and
    validated (the manager's resume, from its listing: parsed once, not twice). No rollback unless
    asked: after a failed load the manager loads an older step in full (or raises), so a host copy
    of the whole state (:mod:`ckpt.read.rollback`) would buy it nothing."""
    whole = stored_whole(set(manifest.values), [*manifest.values, *manifest.tensors])
    state_dict, restore = export_state(state, whole)
    distributed = not no_dist and _distributed()
    group = (process_group or dist.group.WORLD) if distributed else None
    reader = Reader(path, manifest=manifest, storage_options=storage_options, mirrors=mirrors, process_group=group)
    if stats is not None:
        reader.stats = stats
    undo = Rollback() if rollback else None
    try:
        with _quiet_single_process():
            dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(strict=strict, rollback=undo),
                     process_group=process_group, no_dist=not distributed)
    except BaseException as exc:
        if undo is not None:
            undo.restore()  # every region the load wrote, as it was (values are only set below)
        error = _load_error(exc, path, reader)
        if error is exc:
            raise
        raise error from (None if isinstance(exc, CheckpointException) else exc)
    if undo is not None:
        undo.forget()
    restore()
    return manifest


def _load_error(exc: BaseException, path: Location, reader: Reader) -> BaseException:
    """The error a failed ``dcp.load`` surfaces as: ours, unwrapped from DCP's per-rank wrapper; a
    peer this rank lost in the exchange (after which DCP's own collectives fail with the backend's
    RuntimeError); else ``exc`` itself."""
    if isinstance(exc, CheckpointException):
        error = unwrap(exc)
        if isinstance(error, IncompatibleCheckpointError) and error.path is None:
            return error.with_path(path)
        if isinstance(error, CheckpointError):
            error.path = error.path or str(path)
            return error
        return exc
    if isinstance(exc, Exception) and reader.peer_lost is not None:
        return reader.peer_lost
    return exc

"""The ``checkpoint`` section: the trainer's own keys around the engine's :class:`~ckpt.options.SaveOptions`.

Contract: the engine options the section exposes are named once, in :data:`ENGINE_OPTIONS` (in
``--help`` and file order, with the trainer's help text); their types, defaults and allowed values
are :class:`~ckpt.options.SaveOptions`' own (an enum becomes a string of its values, a tuple a list
of strings), except where :data:`TRAINER_DEFAULTS` says otherwise, and
:meth:`CheckpointConfig.save_options` hands exactly these keys to the engine, which validates them.
:data:`CHOICES` lists the enum-valued ones with their values. The trainer's own keys (where the
checkpoints live, what to load, the seed checkpoint) are ordinary fields with attribute docstrings.
The keys, in order: ``enable``, ``folder``, the engine options, ``load_step``, ``branch``,
``save_on_signal``, ``create_seed_checkpoint``, ``initial_load_path``.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ckpt.options import SaveOptions, choices

ENGINE_OPTIONS: dict[str, str] = {
    "replicas": "Further mounts every committed checkpoint is copied to in the background (directories on a "
                "shared file system, s3://bucket/prefix URLs); resuming falls back to them when the primary's "
                "copy is missing or damaged. On the command line: comma-separated.",
    "replica_read_back": "After copying a checkpoint to a replica, read it back and verify every checksum "
                         "(default: sizes are checked).",
    "close_timeout": "Seconds the end of the run waits for pending replication.",
    "interval": "Save at every step that is a multiple of `interval`.",
    "async_mode": "double_buffer: stage to host buffers and write in the background; sync: write inline.",
    "keep": "Number of newest committed checkpoints to keep.",
    "keep_every": "Also keep every checkpoint whose step is a multiple of this; none: only the newest `keep`.",
    "full_every": "Incremental checkpoints: a full checkpoint, then up to full_every-1 lossless deltas "
                  "(1: always full).",
    "compress": "none: store full checkpoints raw; zstd: as zstd-compressed byte planes (deltas always are).",
    "zstd_level": "zstd level for deltas and compressed fulls.",
    "memory": "Memory tier: a directory on each node's RAM file system (e.g. /dev/shm/ckpt, 0700, one folder per "
              "run) where every memory_interval steps each rank's state is kept and copied to a partner node's; a "
              "restart (torchrun --max-restarts, a replaced node) resumes from the newest memory step every rank "
              "can assemble when it is newer than the storage checkpoints, read from RAM and from the partner. "
              "A save that does not fit is skipped with a warning; storage saves (interval) go on as before. "
              "none: off.",
    "memory_interval": "Keep a memory step at every step that is a multiple of this (with memory set) and whose previous memory save has finished: while the writer is busy a step is skipped on every rank, never waited for.",
    "memory_keep": "Newest memory steps kept on each node.",
    "memory_replicas": "1: each node's memory steps are also copied to a partner node (node n -> n + nnodes/2), "
                       "so a lost node's ranks recover from it; 0: no copy.",
    "memory_keep_on_exit": "Keep the run's memory steps after a clean finish (default: removed).",
    "on_error": "What a failed save (disk full, folder not writable) does. stop: the run exits with code 1 as "
                "soon as the failure is known (the next step, or the end), keeping every checkpoint committed "
                "before; a restart resumes from the newest of them and, if the same save fails again, exits at "
                "it again. continue: the run warns, counts the failure (ckpt_failures in the metrics) and trains "
                "on; the next interval retries as a full checkpoint, and the steps it could not write are simply "
                "missing (a restart resumes from the newest one that was written). A create_seed_checkpoint run "
                "always stops.",
}
"""The :class:`~ckpt.options.SaveOptions` fields the section exposes, with the trainer's help text."""

TRAINER_DEFAULTS: dict[str, Any] = {"interval": 10}
"""Where the trainer's default differs from the engine's (a training run saves every 10 steps)."""

_ENGINE_TYPES = typing.get_type_hints(SaveOptions)
_ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(SaveOptions)}


def _enum(name: str) -> type[Enum] | None:
    tp = _ENGINE_TYPES[name]
    return tp if isinstance(tp, type) and issubclass(tp, Enum) else None


def _engine_field(name: str, help: str) -> tuple[str, Any, dataclasses.Field]:
    """``(name, type, field)`` of the section for the engine option ``name``."""
    tp, engine = _ENGINE_TYPES[name], _ENGINE_FIELDS[name]
    default = TRAINER_DEFAULTS.get(name, engine.default)
    meta = {"help": help}
    if _enum(name) is not None:  # the string users write: the member's value
        return name, str, dataclasses.field(default=_enum(name)(default).value, metadata=meta)
    if typing.get_origin(tp) is tuple:  # a list in files and (comma-separated) on the command line
        return name, list[str], dataclasses.field(default_factory=functools.partial(list, default), metadata=meta)
    return name, tp, dataclasses.field(default=default, metadata=meta)


CHOICES: dict[str, tuple[str, ...]] = {name: choices(_enum(name)) for name in ENGINE_OPTIONS if _enum(name)}
"""The enum-valued engine options: key -> allowed values (the engine's enums, not a second list)."""


# The section's keys in order: a dataclass lists its bases' fields first, so _Where's come first, then
# the engine options (_Engine, made from ENGINE_OPTIONS), then CheckpointConfig's own.
@dataclass
class _Where:
    """The trainer's keys before the engine options."""

    enable: bool = False
    """Save checkpoints and resume from them."""
    folder: str = "checkpoints"
    """Checkpoint folder (the primary mount), relative to job.dump_folder unless absolute or a URL
    such as s3://bucket/run (credentials from the standard AWS environment variables)."""


_Engine = dataclasses.make_dataclass(
    "_Engine", [_engine_field(name, help) for name, help in ENGINE_OPTIONS.items()], bases=(_Where,))
_Engine.__module__ = __name__


@dataclass
class CheckpointConfig(_Engine):
    """Checkpointing through ckpt.CheckpointManager."""

    load_step: int | None = None
    """Step to resume from (needs enable); none: the latest committed step, if any. A step that
    is not committed is refused, naming the committed ones."""
    branch: bool = False
    """With load_step older than the newest committed step: delete the committed steps after it (on
    every mount) and train on from it. Without it such a load_step is refused, naming those steps:
    training on would replace them one by one and leave two histories interleaved."""
    save_on_signal: bool = False
    """On SIGTERM/SIGINT (preemption, Ctrl-C) write a checkpoint of the step the run stopped after
    (every rank stops after the same step; the in-flight save finishes either way)."""
    create_seed_checkpoint: bool = False
    """Initialise the model, save it as step 0 and exit (run with a single process)."""
    initial_load_path: str | None = None
    """A checkpoint to take the model's weights from when the run has no checkpoint of its own yet:
    a checkpoint directory, or a root (its newest committed step); a path (relative to the working
    directory) or a URL. E.g. the output of `ckpt-convert HF_DIR DST --from hf`. Only the weights
    are loaded (the tensors under "model."; every one the model has must be there, in its shape and
    dtype): the optimizer, learning-rate schedule and data position start fresh. Ignored once the
    run has a checkpoint in checkpoint.folder (it resumes from that); works with checkpoint.enable
    false too; with create_seed_checkpoint the seed holds these weights."""

    def save_options(self, *, device_type: str | None, user_metadata: dict) -> SaveOptions:
        """The engine's :class:`~ckpt.options.SaveOptions` for this section (after validation).

        ``device_type`` is the staging device ("cuda"/"npu"/"cpu"; None: the accelerator in use)
        and ``user_metadata`` the JSON-able dict recorded in every manifest.
        """
        return SaveOptions(**{name: getattr(self, name) for name in ENGINE_OPTIONS},
                           device_type=device_type, user_metadata=user_metadata)

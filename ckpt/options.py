"""Save options: one typed, validated object for how and when checkpoints are written.

:class:`SaveOptions` is what :class:`~ckpt.manager.CheckpointManager` is configured with, what it
hands to the writer (:class:`~ckpt.dcp.Writer` reads ``files_per_rank``, ``compress``,
``zstd_level`` and ``encode_threads``) and what the trainer's ``checkpoint`` section builds. Modes
and policies are enums whose values are the strings users write (``"double_buffer"``, ``"skip"``,
``"zstd"``); strings are accepted wherever an enum is, and a bad value fails at construction with
:class:`~ckpt.errors.InvalidOptionError` (a ValueError) naming the option and what it must be.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from .errors import InvalidOptionError
from .storage import is_url


class AsyncMode(str, Enum):
    """How a save runs: snapshot to host buffers and write in the background, or write inline."""

    DOUBLE_BUFFER = "double_buffer"
    SYNC = "sync"


class BusyPolicy(str, Enum):
    """What a save does when both staging buffer sets are still being written."""

    BLOCK = "block"
    SKIP = "skip"


class FailurePolicy(str, Enum):
    """What a failed save does: stop (raise it at the next save/wait/close) or continue (warn,
    count it in ``stats.failures`` and try again at the next interval, as a full checkpoint)."""

    STOP = "stop"
    CONTINUE = "continue"


class Compression(str, Enum):
    """How full checkpoints store chunks (deltas are always zstd byte planes)."""

    NONE = "none"
    ZSTD = "zstd"


E = TypeVar("E", bound=Enum)


def as_enum(kind: type[E], value: Any, what: str) -> E:
    """``value`` (an enum member or its string value, any case) as a member of ``kind``."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind(value.strip().lower())
        except ValueError:
            pass
    raise InvalidOptionError(what, value, f"must be one of {', '.join(choices(kind))}")


def choices(kind: type[Enum]) -> tuple[str, ...]:
    """The string values of an enum, for CLIs and config validation."""
    return tuple(member.value for member in kind)


@dataclass(frozen=True)
class SaveOptions:
    """How and when checkpoints are written.

    Attributes:
        interval: ``manager.save(step, ...)`` writes when ``step % interval == 0`` (or forced).
        keep: newest committed steps to keep; ``keep_every``: also keep multiples of it.
        async_mode: double_buffer (snapshot, write in the background) or sync (write in ``save``).
        policy: when both staging buffer sets are busy: block (wait) or skip (drop the save).
        on_error: when a save fails: stop (raise it) or continue (warn and retry at the next
            interval); see :class:`FailurePolicy`.
        full_every: K > 1 writes a full checkpoint, then up to K-1 deltas, each against the
            previous snapshot; needs async_mode double_buffer.
        compress: none, or zstd (full checkpoints as zstd byte planes; deltas always are).
        zstd_level: zstd level for deltas and compressed fulls.
        files_per_rank: data files each rank writes in parallel threads (more helps fast NVMe).
        encode_threads: threads encoding (compressing, delta-coding) chunks; None: one per core.
        device_type: "cuda"/"npu"/"cpu" for staging; None: the accelerator in use, else cpu.
        user_metadata: JSON-able dict recorded in every manifest (``Manifest.user``).
        replicas: URLs or directories every committed step is copied to in the background
            (:mod:`ckpt.root.replicate`); load falls back to them when the primary's copy is bad.
        replica_read_back: after copying, read every blob back from the replica and verify it
            (default: sizes are checked).
        replica_backlog: steps waiting per replica before the oldest waiting one is dropped.
        replica_retry_initial / replica_retry_max: backoff of a failed copy, seconds (doubling).
        close_timeout: seconds ``close()`` waits for pending replication.
        catalog: the LMDB catalog directory; None: ``<root>/.catalog`` for a local root, no
            catalog for a URL root; "" turns it off.
        memory: a directory on each node's RAM file system (e.g. ``/dev/shm/ckpt``) for the memory
            tier (:mod:`ckpt.memory`): every ``memory_interval`` steps each rank's state is kept there
            and copied to a partner node (``memory_replicas`` 1, or 0: none), the newest
            ``memory_keep`` steps kept; a restart resumes from it when it is newer than storage.
            ``memory_keep_on_exit``: keep the run's memory steps after a clean finish. None: off.
    """

    interval: int = 1
    keep: int = 3
    keep_every: int | None = None
    async_mode: AsyncMode = AsyncMode.DOUBLE_BUFFER
    policy: BusyPolicy = BusyPolicy.BLOCK
    on_error: FailurePolicy = FailurePolicy.STOP
    full_every: int = 1
    compress: Compression = Compression.NONE
    zstd_level: int = 1
    files_per_rank: int = 1
    encode_threads: int | None = None
    device_type: str | None = None
    user_metadata: dict = field(default_factory=dict)
    replicas: tuple[str, ...] = ()
    replica_read_back: bool = False
    replica_backlog: int = 16
    replica_retry_initial: float = 1.0
    replica_retry_max: float = 60.0
    close_timeout: float = 300.0
    catalog: str | None = None
    memory: str | None = None
    memory_interval: int = 1
    memory_keep: int = 2
    memory_replicas: int = 1
    memory_keep_on_exit: bool = False

    def __post_init__(self) -> None:
        compress = Compression.NONE if self.compress is None else self.compress
        object.__setattr__(self, "async_mode", as_enum(AsyncMode, self.async_mode, "async_mode"))
        object.__setattr__(self, "policy", as_enum(BusyPolicy, self.policy, "policy"))
        object.__setattr__(self, "on_error", as_enum(FailurePolicy, self.on_error, "on_error"))
        object.__setattr__(self, "compress", as_enum(Compression, compress, "compress"))
        object.__setattr__(self, "user_metadata", dict(self.user_metadata or {}))
        replicas = (self.replicas,) if isinstance(self.replicas, str) else tuple(self.replicas or ())
        object.__setattr__(self, "replicas", tuple(str(r) for r in replicas))
        for name in ("replica_retry_initial", "replica_retry_max", "close_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise InvalidOptionError(name, value, "must be a number of seconds >= 0")
        if self.memory is not None:
            object.__setattr__(self, "memory", os.fspath(self.memory))
            if not self.memory or is_url(self.memory):
                raise InvalidOptionError("memory", self.memory, "must be a directory of a local (RAM) file system")
        if self.memory_replicas not in (0, 1) or isinstance(self.memory_replicas, bool):
            raise InvalidOptionError("memory_replicas", self.memory_replicas, "must be 0 or 1")
        for name in ("interval", "keep", "full_every", "zstd_level", "files_per_rank", "replica_backlog",
                     "memory_interval", "memory_keep"):
            _positive(name, getattr(self, name))
        for name in ("keep_every", "encode_threads"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.full_every > 1 and self.async_mode is not AsyncMode.DOUBLE_BUFFER:
            raise InvalidOptionError("full_every", self.full_every,
                                     "deltas (full_every > 1) need async_mode double_buffer")

    def replace(self, **changes: Any) -> "SaveOptions":
        """A copy with ``changes`` applied (validated like a new object)."""
        return dataclasses.replace(self, **changes)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOptionError(name, value, "must be an integer >= 1")

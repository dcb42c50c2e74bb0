"""The one exception hierarchy of the engine.

Every failure caused by a checkpoint (missing, damaged, hostile, not matching the live state) or by
a request the engine refuses raises a subclass of :class:`CheckpointError`. Callers catch that one
type; CLIs turn it into a single readable line and a non-zero exit.

    CheckpointError
    ├── CheckpointNotFoundError      no committed checkpoint at the path (or no such step)
    ├── CheckpointExistsError        the target is already committed and overwrite was not asked for
    ├── CorruptCheckpointError       bytes or manifest do not verify (names the file and the tensor)
    │   └── InvalidManifestError     the manifest is malformed or hostile (bad names, absurd sizes)
    ├── UnsupportedFormatError       written by a newer format version, or an unknown codec
    ├── UnsafeCheckpointError        a value would need code execution to load
    ├── IncompatibleCheckpointError  the checkpoint does not fit the live state (lists every mismatch)
    ├── CheckpointWriteError         a save failed; nothing was committed
    ├── CheckpointLockedError        another manager already writes to this root
    ├── SnapshotSkipped              both staging buffer sets were busy and the policy is skip
    ├── InvalidOptionError           a save option out of range (also a ValueError)
    ├── DeviceUnavailableError       the requested device type is not present on this machine
    └── PeerLostError                another rank of a load died or stopped answering mid-exchange

Errors cross ranks as objects (pickled by :mod:`ckpt.collective`), so every rank raises the same
type with the same attributes.
"""

from __future__ import annotations

from .redact import redact


class CheckpointError(Exception):
    """Base class of every error raised by the checkpoint engine.

    ``path`` (the checkpoint), ``file`` (inside it, e.g. ``manifest.json`` or
    ``data/rank-00000.bin``) and ``tensor`` (a state-dict key) say what failed, where known."""

    def __init__(self, message: str = "", *, path: str | None = None, file: str | None = None,
                 tensor: str | None = None):
        super().__init__(redact(message))  # never a credential in a line (issue 22, item 5)
        self.path = None if path is None else redact(path)
        self.file, self.tensor = file, tensor


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the given location."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The target checkpoint is already committed and overwriting was not requested."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes do not match what the manifest promises, or the manifest itself is damaged.

    ``file`` and ``tensor`` name what failed to verify, when known.
    """


class InvalidManifestError(CorruptCheckpointError):
    """The manifest is malformed or hostile; nothing was read or written because of it."""


class UnsupportedFormatError(CheckpointError):
    """The checkpoint uses a format version or codec this build cannot read."""


class UnsafeCheckpointError(CheckpointError):
    """Loading a value would require executing code from the checkpoint; refused."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint's contents do not fit the state it is loaded into.

    Attributes list every problem at once: ``missing`` (in the state, not in the checkpoint),
    ``unexpected`` (in the checkpoint, not in the state) and ``mismatched`` (key, what the checkpoint
    holds, what the state holds).
    """

    def __init__(
        self,
        missing: list[str] = (),
        unexpected: list[str] = (),
        mismatched: list[tuple[str, str, str]] = (),
        path: str | None = None,
    ):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        parts = []
        if self.missing:
            parts.append(f"missing from checkpoint: {_short_list(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected in checkpoint: {_short_list(self.unexpected)}")
        for key, saved, live in self.mismatched:
            parts.append(f"{key}: checkpoint has {saved}, state has {live}")
        where = "" if path is None else f" {path}"
        super().__init__(f"checkpoint{where} does not fit the state: " + "; ".join(parts), path=path)

    def with_path(self, path) -> "IncompatibleCheckpointError":
        """The same report, naming the checkpoint."""
        return type(self)(self.missing, self.unexpected, self.mismatched, path=str(path))

    def __reduce__(self):  # rebuilt from its lists when DCP ships it between ranks
        return (type(self), (self.missing, self.unexpected, self.mismatched, self.path))


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; the target was not committed and earlier ones are untouched."""


class CheckpointLockedError(CheckpointError):
    """Another CheckpointManager holds the lock on this checkpoint root; two writers are refused."""


class ForeignRunError(CheckpointError):
    """A mount or a step belongs to another run (``.run`` or its manifest's ``run`` names another
    one): nothing of this run is written there, and nothing there is loaded as this run's."""


class InvalidOptionError(CheckpointError, ValueError):
    """A save option (:class:`~ckpt.options.SaveOptions` field) has a value it cannot take.

    ``option``, ``value`` and ``requirement`` say which, what and why, so front ends (the trainer's
    config) can report it in their own terms."""

    def __init__(self, option: str, value, requirement: str):
        super().__init__(f"{option}={value!r} is invalid: {requirement}")
        self.option, self.value, self.requirement = option, value, requirement

    def __reduce__(self):
        return (type(self), (self.option, self.value, self.requirement))


class SnapshotSkipped(CheckpointError):
    """Every staging buffer set is still being written and the policy is ``skip``: this save was dropped."""


class DeviceUnavailableError(CheckpointError):
    """The requested device type is not present on this machine."""


class PeerLostError(CheckpointError):
    """Another rank of a load's process group stopped answering while chunks were exchanged (its
    process died, its connection broke); ``peer`` is its rank in that group."""

    def __init__(self, message: str = "", *, peer: int | None = None, **where):
        super().__init__(message, **where)
        self.peer = peer


def _short_list(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" … (+{len(names) - limit} more)" if len(names) > limit else "")


class StorageError(CheckpointError, OSError):
    """A mount could not be reached or refused an operation (connection lost, permission denied,
    server errors). The message names the mount by URL only: credentials never appear in it."""

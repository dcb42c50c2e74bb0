"""What a manager's saves and loads come to, as the caller sees it: the counters (:class:`SaveStats`, the stall
included; :class:`LoadStats`, the bytes one load moved on this rank), the report of each commit (:class:`CommitInfo`, given to ``on_commit``), and failures of
background writes (:class:`BackgroundFailures`: recorded by the writer thread, raised — policy
``stop`` — or warned about and counted — ``continue`` — on the training thread at the next due
save, ``wait`` or ``close``; anything that is not a CheckpointError is wrapped in one).
"""

from __future__ import annotations

import logging
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass

from .errors import CheckpointError, CheckpointWriteError
from .options import FailurePolicy

log = logging.getLogger("ckpt.manager")


@dataclass
class SaveStats:
    """Counters of a manager. A save's *stall* is the time training was blocked by it: the host
    inside ``save()`` and in any host wait for its snapshot (before the next optimizer step or a
    forward that changes buffers), plus, on an accelerator, the time the compute stream waited for
    the snapshot copy (``device_stall_s``, measured with timing events; counted once those have
    completed, so a stall may show up a step later)."""

    saves: int = 0
    deltas: int = 0  # saves stored as deltas
    skipped: int = 0
    failures: int = 0  # saves that failed (counted under on_error="continue")
    stall_s: float = 0.0  # host + device
    last_stall_s: float = 0.0
    device_stall_s: float = 0.0
    host_buffer_bytes: int = 0  # staging memory as the (pinned) host allocator reserves it
    memory_saves: int = 0  # steps put in the memory tier (own and partner copies in place)
    memory_skipped: int = 0  # memory saves skipped: the RAM file system had no room on some node
    memory_failures: int = 0  # memory saves that failed on some rank (storage saves unaffected)

    def count_save(self, stall: float, *, stored: bool = True) -> None:
        """One save that stalled training ``stall`` seconds (on the host); ``stored``: it goes to
        storage (a memory-tier-only save counts its stall, not as a save)."""
        self.saves += stored
        self.stall_s += stall
        self.last_stall_s = stall


@dataclass
class LoadStats:
    """What one load moved on this rank. ``bytes_read``: from storage (the data files, a delta's base
    links included; not the manifest); ``bytes_received`` / ``bytes_sent``: stored chunks that several
    ranks need whole, read by one of them and sent to the others over the load's process group
    (decoded bytes); ``chunks_received``: how many came that way. Summed over the ranks of a
    replicated (DDP) load, ``bytes_read`` is one copy of the state."""

    bytes_read: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    chunks_received: int = 0

    def summary(self) -> str:
        """One line for a log: what came from storage and what from peers."""
        line = f"read {self.bytes_read / 2**20:.1f} MiB from storage"
        if self.bytes_received or self.bytes_sent:
            line += (f", {self.bytes_received / 2**20:.1f} MiB from peers, "
                     f"{self.bytes_sent / 2**20:.1f} MiB sent to them")
        return line


@dataclass(frozen=True)
class CommitInfo:
    """What ``on_commit`` is told when a checkpoint committed on the primary (rank 0 only)."""

    step: int
    kind: str  # "full" or "delta"
    bytes: int  # stored bytes of its data (after any encoding)
    seconds: float  # from the start of its write to its commit
    path: str
    replicas: int  # mounts it is now being copied to


def tell_commit(callback, info: CommitInfo) -> None:
    """Call the user's ``on_commit`` (if any) with ``info``; its failure is logged, never a save's."""
    if callback is None:
        return
    try:
        callback(info)
    except Exception as exc:  # the caller's reporting must never fail a save
        log.warning("on_commit callback failed: %s: %s", type(exc).__name__, exc)


class BackgroundFailures:
    """Failures of background writes, oldest first, until the training thread takes them."""

    def __init__(self, policy: FailurePolicy):
        self.policy = policy
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    def add(self, error: BaseException) -> None:
        with self._lock:
            self._errors.append(error)

    def clear(self) -> None:
        with self._lock:
            self._errors.clear()

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._errors)

    def raise_or_warn(self, stats: SaveStats, *, stacklevel: int) -> None:
        """Raise the oldest failure (policy stop), or warn about each and count it (continue)."""
        while True:
            with self._lock:
                if not self._errors:
                    return
                error = self._errors.pop(0)
            if not isinstance(error, CheckpointError):  # an OSError in retention, a bug
                wrapped = CheckpointWriteError(f"a checkpoint write failed: {type(error).__name__}: {error}")
                wrapped.__cause__, error = error, wrapped
            if self.policy is FailurePolicy.STOP:
                raise error
            stats.failures += 1
            log.warning("checkpoint save failed (%s); training continues, the next save retries", error)
            warnings.warn(f"checkpoint save failed ({error}); continuing (on_error='continue')",
                          stacklevel=stacklevel)


class SavesInFlight:
    """The saves being written, key (the manager's step, a plug-in's path) → future: added by ``save``
    on the training thread, removed when the write ends, read by the writer thread (retention must
    not delete a step being written)."""

    def __init__(self) -> None:
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()

    def add(self, step: int, future: Future) -> None:
        with self._lock:
            self._futures[step] = future

    def remove(self, step: int) -> None:
        with self._lock:
            self._futures.pop(step, None)

    def writing(self, besides: int) -> set[int]:
        """The steps still being written, ``besides`` left out."""
        with self._lock:  # copied, then asked: done() is never called under the lock add() takes
            futures = list(self._futures.items())
        return {step for step, future in futures if not future.done()} - {besides}

    def drain(self, *keys) -> None:
        """Wait for the saves of ``keys`` in flight, default every one (their errors are recorded by
        the pipeline's done callback)."""
        with self._lock:
            pending = [f for k, f in self._futures.items() if not keys or k in keys]
        for future in pending:
            try:
                future.result()
            except BaseException:
                pass

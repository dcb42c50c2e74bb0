"""Replication: committed steps copied from the primary to replica mounts, verified, in the background.

    copy_step(source, target)          one step, now (collective over ``group`` when given)
    Replicator(primary, replicas, ...) the manager's background copier: submit(step), status(), close()

Contract of one copy (:func:`copy_step`):

1. Rank 0 reads the source manifest (its digest checked) and starts an attempt on the target with
   that mount's commit protocol (:mod:`ckpt.commit`); a target already committed is left as it is.
2. Every rank copies its share of the data files — the files a rank wrote (``rank-00003`` in the
   name; with another world size, rank index modulo world size) — streaming: every blob's xxh3-64
   is computed over the bytes as they pass and compared with the manifest before the file is
   finished, so corruption on the source is never committed on a replica. Each written file is
   finished durably and its size checked; with ``read_back=True`` every blob is then read back from
   the replica and verified (:func:`ckpt.read.verify_blobs`).
3. Only when every rank succeeded does rank 0 write the manifest — the primary's bytes, unchanged —
   on the replica: the commit point. Otherwise the attempt is removed.

The :class:`Replicator` runs one worker per replica mount (its own gloo group when distributed, so
its collectives never meet training's or the writer's). Every rank queues the same steps in the same
order; a worker retries a failed copy with exponential backoff (``retry_initial`` doubling up to
``retry_max``) for as long as the mount is down, then catches up on what queued meanwhile; at start it
queues the primary's steps the mount lacks. A delta's base is copied first when the mount lacks it.
The backlog is bounded: when more than ``backlog`` steps wait, the oldest waiting one is dropped
(the newest steps matter for resuming; a dropped step is still copied later if it is the base of a
newer one). After each commit on a mount, retention is applied there with the primary's policy,
chain-aware. State changes (pending, copying, committed, failed, dropped) are logged one line each and
handed to ``on_state`` (the catalog). Nothing here ever blocks training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import torch.distributed as dist
import xxhash

from . import commit, retention
from .collective import any_rank, broadcast_error
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .format import Blob, Manifest, data_file_rank
from .committed import read_manifest_bytes
from .read import DataFiles, verify_blobs
from .root import CheckpointRoot
from .storage import Location

log = logging.getLogger(__name__)

SLICE = 16 << 20

PENDING, COPYING, COMMITTED, FAILED, DROPPED = "pending", "copying", "committed", "failed", "dropped"


class SourceCorruptError(CorruptCheckpointError):
    """The primary's copy of a step fails verification: copying it again cannot help (final)."""


# -- one step ------------------------------------------------------------------------------------

def files_of_rank(manifest: Manifest, rank: int, world: int) -> list[str]:
    """The data files ``rank`` of ``world`` copies: those it wrote (by the rank in their name)."""
    mine = []
    for name in sorted(manifest.data_files()):
        owner = data_file_rank(name)
        if (0 if owner is None else owner) % world == rank:
            mine.append(name)
    return mine


def _blobs_by_file(manifest: Manifest) -> dict[str, list[tuple[str, Blob]]]:
    by_file: dict[str, dict[tuple[int, int], tuple[str, Blob]]] = {}
    for key, blob in manifest.blobs():
        by_file.setdefault(blob.file, {})[(blob.offset, blob.length)] = (key, blob)
    return {name: [blobs[k] for k in sorted(blobs)] for name, blobs in by_file.items()}


def copy_file(source: DataFiles, target: Location, name: str, blobs: list[tuple[str, Blob]],
              size: int | None = None) -> int:
    """Stream the data file ``name`` (``size`` bytes, as its manifest records) from ``source`` to
    ``target/name``, verifying every blob as it passes; returns the bytes written. A mismatch
    aborts the file (nothing of it stays)."""
    reader = source.open(name)
    if size is not None and reader.size != size:
        raise SourceCorruptError(f"{source.root}: {name} holds {reader.size} bytes, its manifest says {size}",
                                 path=str(source.root), file=name)
    out = target.storage.create((target / name).path)
    buffer = memoryview(bytearray(min(SLICE, max(reader.size, 1))))
    position = 0

    def move(end: int, hasher=None) -> None:
        nonlocal position
        while position < end:
            piece = buffer[: min(len(buffer), end - position)]
            if reader.read_into(piece, position) != len(piece):
                raise SourceCorruptError(f"{source.root}: {name} ended early at byte {position}",
                                         path=str(source.root), file=name)
            if hasher is not None:
                hasher.update(piece)
            out.write(piece)
            position += len(piece)

    try:
        for what, blob in blobs:
            if blob.offset < position or blob.offset + blob.length > reader.size:
                raise SourceCorruptError(f"{source.root}: {what} lies outside {name} or overlaps another blob",
                                         path=str(source.root), file=name, tensor=what)
            move(blob.offset)  # alignment padding
            hasher = xxhash.xxh3_64()
            move(blob.offset + blob.length, hasher)
            try:
                source.verify(blob, f"{hasher.intdigest():016x}", what=what)
            except CorruptCheckpointError as exc:
                raise SourceCorruptError(str(exc), path=exc.path, file=exc.file, tensor=exc.tensor) from None
        move(reader.size)
        written = out.close()
    except BaseException:
        out.abort()
        raise
    if written != reader.size:
        raise StorageError(f"{target / name} holds {written} bytes, the source {reader.size}", path=str(target))
    return written


def _share(value, group, distributed: bool):
    if not distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def copy_step(source: Location, target: Location, *, read_back: bool = False, group=None,
              distributed: bool = False) -> int:
    """Copy the committed checkpoint ``source`` to ``target`` (see the module docstring); returns the
    bytes this rank copied. Collective over ``group`` when ``distributed``."""
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    plan, attempt, error = None, None, None
    if rank == 0:
        try:
            try:
                manifest, raw = read_manifest_bytes(source)
            except CheckpointNotFoundError:
                raise
            except CorruptCheckpointError as exc:  # the source's manifest: final, like its data
                raise SourceCorruptError(str(exc), path=exc.path, file=exc.file) from None
            if commit.is_committed(target):
                plan = "done"
            else:  # anything there without a manifest (a killed copy or deletion) is garbage: replaced
                attempt = commit.begin(target, overwrite=True)
                plan = (raw, attempt.directory.path)
        except Exception as exc:
            error = exc
    error = broadcast_error(error, group, distributed=distributed)
    if error is not None:
        raise error
    plan = _share(plan, group, distributed)
    if plan == "done":
        return 0
    raw, directory = plan
    manifest = Manifest.from_json(raw, source=str(source))
    directory = Location(target.storage, directory)
    copied, local = 0, None
    try:
        mine = files_of_rank(manifest, rank, world)
        blobs = _blobs_by_file(manifest)
        files = DataFiles(source)
        try:
            for name in mine:
                copied += copy_file(files, directory, name, blobs.get(name, []), manifest.files.get(name))
        finally:
            files.close()
        if read_back:
            verify_blobs(directory, manifest, files=mine)
    except Exception as exc:
        local = exc
    failed, corrupt = any_rank((local is not None, isinstance(local, SourceCorruptError)), group,
                               distributed=distributed)
    result = None
    if rank == 0:
        try:
            if failed:
                commit.abort(attempt)
            else:
                commit.finish(attempt, manifest, overwrite=True, raw=raw)  # replacing only what had no manifest
        except Exception as exc:
            result = exc
    if local is not None:
        raise local
    result = broadcast_error(result, group, distributed=distributed)
    if result is not None:
        raise result
    if corrupt:
        raise SourceCorruptError(f"{source} failed verification on another rank; not replicated", path=str(source))
    if failed:
        raise StorageError(f"copying {source} to {target} failed on another rank", path=str(target))
    return copied


# -- the background copier -----------------------------------------------------------------------

class _MountWorker:
    """Copies queued steps to one replica mount (see the module docstring)."""

    def __init__(self, owner: "Replicator", mount: CheckpointRoot, group):
        self.owner, self.mount, self.group = owner, mount, group
        self.url = str(mount.path)
        self.queue: deque[int] = deque()
        self.states: dict[int, str] = {}
        self.thread = threading.Thread(target=self._run, name=f"ckpt-replica-{self.url}", daemon=True)

    def set_state(self, step: int, state: str, detail: str = "") -> None:
        with self.owner.lock:
            if self.states.get(step) == state:
                return
            self.states[step] = state
        log.info("replica %s step %d: %s%s", self.url, step, state, f" ({detail})" if detail else "")
        if self.owner.on_state is not None:
            try:
                self.owner.on_state(self.url, step, state, detail)
            except Exception as exc:  # the catalog is a cache: never let it stop replication
                log.warning("recording the replication state of step %d failed: %s", step, exc)

    def enqueue(self, step: int) -> None:
        with self.owner.lock:
            if step in self.queue:
                return
            self.queue.append(step)
            dropped = self.queue.popleft() if len(self.queue) > self.owner.backlog else None
            self.owner.lock.notify_all()
        self.set_state(step, PENDING)
        if dropped is not None:
            self.set_state(dropped, DROPPED, f"backlog of {self.owner.backlog} steps full")

    def _next(self) -> int | None:
        with self.owner.lock:
            while not self.queue and not self.owner.closing:
                self.owner.lock.wait()
            return self.queue.popleft() if self.queue else None

    def _run(self) -> None:
        try:
            self._work()
        except Exception:  # a bug or a broken process group: say so loudly, training goes on
            log.exception("replication to %s stopped", self.url)
            with self.owner.lock:
                waiting, self.queue = list(self.queue), deque()
            for step in waiting:
                self.set_state(step, PENDING, "replication stopped; copied when a manager next starts")

    def _work(self) -> None:
        self._catch_up()
        while (step := self._next()) is not None:
            late = self.owner.deadline is not None and time.monotonic() >= self.owner.deadline
            if any_rank((late,), self.group, distributed=self.owner.distributed)[0]:  # every rank stops together
                self.set_state(step, PENDING, "abandoned at close; copied when a manager next starts")
                return
            if not self._replicate(step):
                return

    def _catch_up(self) -> None:
        """Queue the primary's steps this mount lacks (all ranks queue the same list)."""
        missing, error = [], None
        if self.owner.rank == 0:
            try:
                have = set(self.mount.committed())
                missing = [s for s in self.owner.primary.steps() if s not in have]
            except CheckpointError as exc:
                error = exc
        missing = _share(missing, self.group, self.owner.distributed)
        if error is not None:
            log.warning("replica %s cannot be listed (%s); copies will retry", self.url, error)
        for step in missing[-self.owner.backlog:]:
            self.enqueue(step)

    def _replicate(self, step: int) -> bool:
        """Copy ``step`` (its missing bases first) until it is committed or dropped; False when
        closing abandoned it."""
        failures = 0
        while True:
            self.set_state(step, COPYING)
            try:
                self._copy_with_bases(step)
                self.set_state(step, COMMITTED)
                self._retain()
                return True
            except CheckpointNotFoundError as exc:
                self.set_state(step, DROPPED, f"gone from the primary: {exc}")
                return True
            except SourceCorruptError as exc:  # never replicate corruption; later steps go on
                log.error("replica %s step %d: not copied, the primary's copy is corrupt (%s)", self.url, step, exc)
                self.set_state(step, DROPPED, f"corrupt on the primary: {exc}")
                return True
            except Exception as exc:
                failures += 1
                delay = min(self.owner.retry_initial * 2 ** (failures - 1), self.owner.retry_max)
                self.set_state(step, FAILED, f"attempt {failures}: {exc}; retrying in {delay:.1f} s")
            give_up = self.owner.wait_or_deadline(delay)
            if any_rank((give_up,), self.group, distributed=self.owner.distributed)[0]:
                self.set_state(step, PENDING, "abandoned at close; copied when a manager next starts")
                return False

    def _copy_with_bases(self, step: int) -> None:
        chain, error = [step], None
        if self.owner.rank == 0:
            try:
                bases = self.owner.primary.bases(self.owner.primary.committed())
                while isinstance(bases.get(chain[-1]), int) and not self.mount.is_committed(bases[chain[-1]]):
                    chain.append(bases[chain[-1]])
            except CheckpointError as exc:
                error = exc
        error = broadcast_error(error, self.group, distributed=self.owner.distributed)
        if error is not None:
            raise error
        for link in reversed(_share(chain, self.group, self.owner.distributed)):
            copy_step(self.owner.primary.step_path(link), self.mount.step_path(link),
                      read_back=self.owner.read_back, group=self.group, distributed=self.owner.distributed)
            if link != step:
                self.set_state(link, COMMITTED, f"base of step {step}")

    def _retain(self) -> None:
        if self.owner.rank != 0 or self.owner.keep is None:
            return
        try:
            committed = self.mount.committed()
            bases = self.mount.bases(committed)
            doomed = retention.steps_to_delete(committed, keep=self.owner.keep, keep_every=self.owner.keep_every,
                                               bases={s: b for s, b in bases.items() if isinstance(b, int)})
            for old in sorted(doomed, reverse=True):
                self.mount.delete(old)
                with self.owner.lock:
                    self.states.pop(old, None)
                log.info("replica %s retention: deleted step %d", self.url, old)
                if self.owner.on_state is not None:
                    self.owner.on_state(self.url, old, "deleted", "retention")
        except Exception as exc:
            log.warning("retention on replica %s failed: %s", self.url, exc)


class Replicator:
    """Background replication of a primary root to replica roots (see the module docstring).

    Every rank constructs it with the same mounts and submits the same steps in the same order;
    ``groups`` holds one process group per mount (None entries when not distributed)."""

    def __init__(self, primary: CheckpointRoot, replicas: list[CheckpointRoot], *, groups: list | None = None,
                 distributed: bool = False, keep: int | None = None, keep_every: int | None = None,
                 read_back: bool = False, backlog: int = 16, retry_initial: float = 1.0, retry_max: float = 60.0,
                 on_state: Callable[[str, int, str, str], None] | None = None):
        self.primary, self.distributed = primary, distributed
        self.rank = dist.get_rank() if distributed else 0
        self.keep, self.keep_every, self.read_back, self.backlog = keep, keep_every, read_back, max(1, backlog)
        self.retry_initial, self.retry_max, self.on_state = retry_initial, retry_max, on_state
        self.lock = threading.Condition()
        self.closing, self.deadline = False, None
        self.groups = groups = list(groups or [None] * len(replicas))
        self.workers = [_MountWorker(self, mount, group) for mount, group in zip(replicas, groups)]
        for worker in self.workers:
            worker.thread.start()

    def submit(self, step: int) -> None:
        """Queue a step just committed on the primary for every replica."""
        for worker in self.workers:
            worker.enqueue(step)

    def status(self) -> dict[int, dict[str, str]]:
        """``{step: {replica url: state}}`` for every step seen since start."""
        with self.lock:
            table: dict[int, dict[str, str]] = {}
            for worker in self.workers:
                for step, state in worker.states.items():
                    table.setdefault(step, {})[worker.url] = state
            return dict(sorted(table.items()))

    def wait_or_deadline(self, delay: float) -> bool:
        """Sleep ``delay`` seconds (less when closing); True when a close's deadline has passed."""
        with self.lock:
            end = time.monotonic() + delay
            while not (self.deadline is not None and time.monotonic() >= self.deadline):
                left = end - time.monotonic()
                if left <= 0:
                    break
                wait = left if self.deadline is None else min(left, max(0.0, self.deadline - time.monotonic()))
                self.lock.wait(wait)
            return self.deadline is not None and time.monotonic() >= self.deadline

    def close(self, timeout: float) -> bool:
        """Let the workers finish what is queued, for at most ``timeout`` seconds; True when every
        queued step reached a final state."""
        with self.lock:
            self.closing, self.deadline = True, time.monotonic() + timeout
            self.lock.notify_all()
        for worker in self.workers:
            worker.thread.join()
        return all(not w.queue and all(s in (COMMITTED, DROPPED) for s in w.states.values()) for w in self.workers)

"""Replication: committed steps copied from the primary to replica mounts in the background.

    Replicator(primary, replicas, options, ...)  the manager's background copier: submit(step), status(), close()
    ReplicaOptions.of(save_options)              how it copies: retention, read-back, backlog, backoff

The :class:`Replicator` runs one worker per replica mount (its own gloo group when distributed, so
its collectives never meet training's or the writer's); each copy is :func:`~ckpt.root.copy.copy_step`.
Every rank queues the same steps in the same order; a worker retries a failed copy with exponential
backoff (``retry_initial`` doubling up to ``retry_max``) for as long as the mount is down, then
catches up on what queued meanwhile. At start (and, while the mount is down, again before each copy)
a worker claims its mount for the run: the mount's lock, taken as the primary's is (flock, or a lease
on object stores, whose fence guards each commit and deletion there), then its ``.run`` record
(:mod:`ckpt.root.claim`); a mount that belongs to another run is refused for good (one error line
naming both runs; its steps are ``refused``) and never written. Once claimed, the worker cleans the
mount up (what dead copies and interrupted deletions left: the same start-up clean-up the primary
gets when it is locked) and queues the primary's steps the mount lacks or holds stale. A delta's
base is copied first when the mount lacks it. A stale copy — a step the mount holds with another
manifest than the primary's: the abandoned history of a branch made while the mount was left out —
is deleted there, with the mount's steps built on it, before the primary's step is copied in its
place (:func:`~ckpt.root.copy.copy_step` itself never replaces a committed step). The backlog is
bounded: when more than ``backlog`` steps wait, the oldest waiting one is dropped (the newest steps
matter for resuming; a dropped step is still copied later if it is the base of a newer one). After
each commit on a mount, retention is applied there with the primary's policy
(:func:`ckpt.root.retention.apply`). A branch (``CheckpointManager.discard_after``) holds ``branching``,
which each copy and catch-up listing hold too: no copy commits a step after the branch deleted it.
State changes (:class:`~ckpt.root.replica_states.ReplicaState`) are logged one line each and handed
to ``on_state`` (the catalog). Nothing here ever blocks training.

The primary is the manager's own :class:`~ckpt.root.steps.CheckpointRoot` (one object per mount and
run: its base map is shared, never read twice).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import torch.distributed as dist

from ..read.chain import listed_base, walk
from ..read.committed import read_manifest_bytes
from ..collective import any_rank, broadcast_error, broadcast_value
from ..errors import CheckpointError, CheckpointLockedError, CheckpointNotFoundError, ForeignRunError, StorageError
from . import retention
from .claim import claim_replica, foreign, read_claim
from .copy import SourceCorruptError, TargetConflictError, copy_step, holds_copy
from .replica_options import ReplicaOptions
from .replica_states import FINAL, ReplicaState
from .steps import CheckpointRoot

log = logging.getLogger(__name__)

# ckpt.root.replica_states; DELETED is told to on_state only, REFUSED is final (another run's mount)
PENDING, COPYING, COMMITTED, FAILED, DROPPED, REFUSED, DELETED = ReplicaState


class _MountWorker:
    """Copies queued steps to one replica mount (see the module docstring)."""

    def __init__(self, owner: "Replicator", mount: CheckpointRoot, group):
        self.owner, self.mount, self.group = owner, mount, group
        self.url = str(mount.path)
        self.queue: deque[int] = deque()
        self.states: dict[int, ReplicaState] = {}
        self.cleaned = False  # claimed for the run and cleaned up (rank 0)
        self.foreign: ForeignRunError | None = None  # rank 0 found the mount is another run's
        self.refused: ForeignRunError | None = None  # ... and every rank knows it: final
        self.unclaimed: BaseException | None = None  # why the last claim failed (rank 0)
        self.thread = threading.Thread(target=self._run, name=f"ckpt-replica-{self.url}", daemon=True)

    def set_state(self, step: int, state: ReplicaState, detail: str = "") -> None:
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
        if self.refused is not None:  # set on every rank at once (the same copy refused everywhere)
            self.set_state(step, REFUSED, str(self.refused))
            return
        with self.owner.lock:
            if step in self.queue:
                return
            self.queue.append(step)
            dropped = self.queue.popleft() if len(self.queue) > self.owner.options.backlog else None
            self.owner.lock.notify_all()
        self.set_state(step, PENDING)
        if dropped is not None:
            self.set_state(dropped, DROPPED, f"backlog of {self.owner.options.backlog} steps full")

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
        finally:
            self.mount.unlock()

    def _work(self) -> None:
        self._clean_up()
        self._catch_up()
        while (step := self._next()) is not None:
            late = self.owner.past_deadline()
            if any_rank((late,), self.group, distributed=self.owner.distributed)[0]:  # every rank stops together
                self.set_state(step, PENDING, "abandoned at close; copied when a manager next starts")
                return
            if not self._replicate(step):
                return

    def _clean_up(self) -> None:
        """Rank 0: claim the mount for the run, then clean up what dead copies and interrupted
        deletions left there, once (the replica's start-up clean-up,
        :meth:`~ckpt.root.steps.CheckpointRoot.clean_up`). A mount that cannot be claimed now (down,
        or its lock held) is tried again before the next copy; one that belongs to another run is
        refused for good (:attr:`foreign`; the next copy tells every rank)."""
        if self.owner.rank != 0 or self.cleaned or self.foreign is not None or self.owner.past_deadline():
            return
        try:
            self._claim()
            self.cleaned = True
        except ForeignRunError as exc:
            self.foreign = exc
            log.error("replica %s refused: %s", self.url, exc)
        except (CheckpointError, OSError) as exc:
            self.unclaimed = exc
            log.warning("replica %s: cannot be claimed and cleaned up now (%s); tried again before the next copy",
                        self.url, exc)

    def _claim(self) -> None:
        run, primary = self.owner.run, self.owner.primary.path.display_name
        if run is None:
            self.mount.lock()
            return
        record = read_claim(self.mount.path)  # another run's mount is refused before its lock is even tried
        if record is not None and record["run"] != run:
            raise foreign(self.mount.path, record["run"], run)
        self.mount.lock(claim=lambda mount: (claim_replica(mount, run, primary), run)[1])

    def _catch_up(self) -> None:
        """Queue the primary's steps this mount lacks or holds stale (all ranks queue the same list)."""
        missing, error = [], None
        if self.owner.rank == 0 and not self.owner.past_deadline():  # closing, its time up: nothing more to queue
            try:
                with self.owner.branching:  # both listings on one side of a branch's deletions
                    have = set(self.mount.committed())
                    missing = [s for s in self.owner.primary.steps() if s not in have or self._stale(s)]
            except CheckpointError as exc:
                error = exc
        missing = broadcast_value(missing, self.group, distributed=self.owner.distributed)
        if error is not None:
            log.warning("replica %s cannot be listed (%s); copies will retry", self.url, error)
        for step in missing[-self.owner.options.backlog:]:
            self.enqueue(step)

    def _stale(self, step: int) -> bool:
        """Rank 0: whether the mount holds ``step`` with another manifest than the primary's (a
        manifest that cannot be read now counts as held: the copy of a later step looks again)."""
        try:
            return not holds_copy(self.mount.step_path(step), read_manifest_bytes(self.owner.primary.step_path(step))[1])
        except TargetConflictError:
            return True
        except (CheckpointError, OSError):
            return False

    def _replicate(self, step: int) -> bool:
        """Copy ``step`` (its missing bases first) until it is committed or dropped; False when
        closing abandoned it."""
        failures = 0
        while True:
            self.set_state(step, COPYING)
            try:
                with self.owner.branching:  # a branch's deletions wait for the copy: none commits after them
                    self._copy_with_bases(step)
                self.set_state(step, COMMITTED)
                self._retain()
                return True
            except CheckpointNotFoundError as exc:
                self.set_state(step, DROPPED, f"gone from the primary: {exc}")
                return True
            except ForeignRunError as exc:  # final: this mount is never written
                self.refused = exc
                with self.owner.lock:
                    waiting, self.queue = [step, *self.queue], deque()
                for refused in waiting:
                    self.set_state(refused, REFUSED, str(exc))
                return False
            except SourceCorruptError as exc:  # never replicate corruption; later steps go on
                log.error("replica %s step %d: not copied, the primary's copy is corrupt (%s)", self.url, step, exc)
                self.set_state(step, DROPPED, f"corrupt on the primary: {exc}")
                return True
            except Exception as exc:
                if isinstance(exc, CheckpointLockedError) and self.owner.rank == 0:  # its lease lost: claim anew
                    self.mount.unlock()
                    self.cleaned = False
                failures += 1
                delay = min(self.owner.options.retry_initial * 2 ** (failures - 1), self.owner.options.retry_max)
                self.set_state(step, FAILED, f"attempt {failures}: {exc}; retrying in {delay:.1f} s")
            give_up = self.owner.wait_or_deadline(delay)
            if any_rank((give_up,), self.group, distributed=self.owner.distributed)[0]:
                self.set_state(step, PENDING, "abandoned at close; copied when a manager next starts")
                return False

    def _copy_with_bases(self, step: int) -> None:
        self._clean_up()
        chain, error = [step], None
        if self.owner.rank == 0:
            try:
                if self.foreign is not None:
                    raise self.foreign
                if not self.cleaned:
                    raise StorageError(f"{self.url} cannot be claimed for this run now ({self.unclaimed})",
                                       path=self.url)
                base_of = listed_base(self.owner.primary.bases(self.owner.primary.committed()))
                if not self._holds(step):  # then each base the mount lacks, down to one it holds
                    chain = list(walk(step, lambda link: base if (base := base_of(link)) is not None
                                      and not self._holds(base) else None))
            except (CheckpointError, OSError) as exc:
                error = exc
        error = broadcast_error(error, self.group, distributed=self.owner.distributed)
        if error is not None:
            raise error
        for link in reversed(broadcast_value(chain, self.group, distributed=self.owner.distributed)):
            copy_step(self.owner.primary.step_path(link), self.mount.step_path(link),
                      read_back=self.owner.options.read_back, group=self.group, distributed=self.owner.distributed,
                      fence=self.mount.check_held)
            if link != step:
                self.set_state(link, COMMITTED, f"base of step {step}")

    def _holds(self, step: int) -> bool:
        """Rank 0: whether the mount holds the primary's ``step``. A stale copy there — committed with
        another manifest: the abandoned history of a branch made while this run's mount was out of
        reach — is deleted first, with every step on the mount whose delta chain builds on it (newest
        first), so that the primary's step is copied in its place."""
        raw = read_manifest_bytes(self.owner.primary.step_path(step))[1]
        try:
            return holds_copy(self.mount.step_path(step), raw, self.owner.primary.step_path(step))
        except TargetConflictError as exc:
            log.warning("replica %s step %d: a stale copy, replaced (%s)", self.url, step, exc)
        retention.discard_with_dependents(self.mount, step,
                                          deleted=lambda gone: self._deleted(gone, "a stale copy (another history's)"))
        return False

    def _retain(self) -> None:
        """Rank 0: the primary's retention policy applied to this mount (:func:`~ckpt.root.retention.apply`)."""
        if self.owner.rank != 0 or self.owner.options.keep is None:
            return
        try:
            retention.apply(self.mount, keep=self.owner.options.keep, keep_every=self.owner.options.keep_every, deleted=self._deleted)
        except Exception as exc:
            log.warning("retention on replica %s failed: %s", self.url, exc)

    def _deleted(self, step: int, why: str = "retention") -> None:
        with self.owner.lock:
            self.states.pop(step, None)
        if self.owner.on_state is not None:
            self.owner.on_state(self.url, step, DELETED, why)


class Replicator:
    """Background replication of a primary root to replica roots (see the module docstring).

    Every rank constructs it with the same mounts and submits the same steps in the same order;
    ``groups`` holds one process group per mount (None entries when not distributed)."""

    def __init__(self, primary: CheckpointRoot, replicas: list[CheckpointRoot],
                 options: ReplicaOptions = ReplicaOptions(), *, groups: list | None = None, distributed: bool = False,
                 on_state: Callable[[str, int, ReplicaState, str], None] | None = None, run: str | None = None):
        self.primary, self.options, self.distributed, self.run = primary, options, distributed, run
        self.rank = dist.get_rank() if distributed else 0
        self.on_state = on_state
        self.lock = threading.Condition()
        self.branching = threading.Lock()  # see the module docstring
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
            while not self.past_deadline():
                left = end - time.monotonic()
                if left <= 0:
                    break
                wait = left if self.deadline is None else min(left, max(0.0, self.deadline - time.monotonic()))
                self.lock.wait(wait)
            return self.past_deadline()

    def past_deadline(self) -> bool:
        """Closing, and its ``timeout`` is up: no new call to a mount is started."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def close(self, timeout: float) -> bool:
        """Let the workers finish what is queued, for at most ``timeout`` seconds; True when every
        queued step reached a final state."""
        with self.lock:
            self.closing, self.deadline = True, time.monotonic() + timeout
            self.lock.notify_all()
        for worker in self.workers:
            worker.thread.join()
        return all(not w.queue and all(s in FINAL for s in w.states.values())
                   for w in self.workers)

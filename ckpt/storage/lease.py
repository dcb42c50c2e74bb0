"""The writer lock of a root on a mount without ``flock`` (object stores): a lease, and its fence.

``.lock`` holds the holder's host, pid, a token and the time it was last renewed; a heartbeat renews
it every quarter of :data:`LEASE_SECONDS` while held. A lock not renewed for :data:`LEASE_SECONDS`,
released, or held by a dead process on this host, is taken over.

**Every write of the record is a compare-and-swap** (:mod:`ckpt.storage.conditional`): a taker
creates it only while there is none (``If-None-Match: *``) and takes over a stale one only while it
is still the version it judged stale (``If-Match: <etag>``); the holder renews and releases it only
while it is still the version it wrote last. So of any number of racing takers exactly one succeeds,
however they are scheduled (no timing decides it), and the others read the winner's record and get
:class:`~ckpt.errors.CheckpointLockedError` naming it. Release deletes the record with
``If-Match`` where the store enforces that on DELETE, and otherwise replaces it by a released record
(a taker takes that over at once).

A mount whose store does not enforce conditional writes (it ignores or rejects the headers; every
fsspec mount that is not S3) gets no lease: :class:`~ckpt.errors.StorageError` says so. A lease
written and read back there can admit two holders, and two holders can destroy each other's
committed steps, so the engine refuses rather than pretend.

The fence (:meth:`LeaseLock.check`): before each commit point and each deletion the holder reads the
record back; when another writer's token is there (this holder was paused past its lease and was
taken over) the lock is lost for good: the heartbeat stops, and every later check raises
:class:`~ckpt.errors.CheckpointLockedError` — nothing more is committed or deleted by the stale
holder. A holder past half its lease renews it (conditionally) before going on. What is left is the
time between the check and the one PUT that follows it: a holder paused exactly there for a whole
lease can still commit once (what it may then delete is bounded by :mod:`ckpt.commit.object_store`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from ..errors import CheckpointError, CheckpointLockedError, StorageError
from .base import Storage

log = logging.getLogger(__name__)

LEASE_SECONDS = 60.0
wall_clock = time.time  # the time a record's "renewed" is written in and judged by (tests move it)
RECORD_LIMIT = 1 << 16
TAKE_TRIES = 8  # a record that keeps changing under a taker (each change a stale or released record)


class LeaseLock:
    """The writer lock of a root on an object store (see the module docstring); ``release()`` ends it.
    ``clock`` (monotonic seconds) decides when the holder renews; tests drive it."""

    def __init__(self, storage: Storage, path: str, holder: str, *, clock: Callable[[], float] = time.monotonic):
        self.storage, self.path, self.token, self.clock = storage, path, uuid.uuid4().hex, clock
        self.record = {"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "token": self.token}
        self.lost: CheckpointLockedError | None = None
        self.etag: str | None = None  # the version of the record this holder wrote last
        self._guard = threading.Lock()  # the heartbeat and the fence never renew at once
        self._thread: threading.Thread | None = None
        directory = path.rsplit("/", 1)[0]
        if not storage.conditional_writes(directory):
            raise StorageError(
                f"{storage.display(directory)} cannot hold a writer lock: its store does not enforce "
                "conditional writes (PUT If-None-Match / If-Match), so two writers could not be kept "
                "apart; use S3 or a store that does, or a local root", path=storage.display(directory))
        self._take()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        """Create the record, or take over a stale one, by compare-and-swap; refused when another
        writer's live record is there (also when its PUT won a race with this one)."""
        current = None
        for _ in range(TAKE_TRIES):
            found = self._read()
            if found is not None:
                current, seen = found
                if current.get("token") == self.token:  # this taker's PUT landed (then was retried)
                    self.etag, self.renewed = seen, self.clock()
                    return
                if not self._stale(current):
                    self._refuse(current)
            etag = self.storage.write_if(self.path, self._body(), etag=None if found is None else seen)
            if etag is not None:
                self.etag, self.renewed = etag, self.clock()
                return
            # the condition failed: another writer changed the record first; its record decides
        self._refuse(current or {}, why="the record kept changing")

    def _read(self) -> tuple[dict, str] | None:
        """``(record, etag)``; an unreadable record is ``{}`` (stale); None when there is none."""
        found = self.storage.read_tagged(self.path, RECORD_LIMIT)
        if found is None:
            return None
        raw, etag = found
        try:
            record = json.loads(raw)
        except ValueError:
            record = {}
        return (record if isinstance(record, dict) else {}), etag

    def _body(self, **extra) -> bytes:
        return json.dumps({**self.record, "renewed": wall_clock(), **extra}).encode()

    def _renew(self) -> None:
        """Renew while the record is still this holder's version; lose the lock when it is not."""
        etag = self.storage.write_if(self.path, self._body(), etag=self.etag)
        if etag is None:
            found = self._read()
            if found is None or found[0].get("token") != self.token:
                raise self._lose(None if found is None else found[0])
            etag = found[1]  # this holder's own PUT landed, then was retried
        self.etag, self.renewed = etag, self.clock()

    def check(self) -> None:
        """The fence: raise :class:`~ckpt.errors.CheckpointLockedError` when this holder no longer
        holds the lease (see the module docstring); renew one past half its time."""
        with self._guard:
            if self.lost is not None:
                raise self.lost
            found = self._read()
            if found is None or found[0].get("token") != self.token:
                raise self._lose(None if found is None else found[0])
            self.etag = found[1]
            if self.clock() - self.renewed > LEASE_SECONDS / 2:  # paused, or the heartbeat late
                self._renew()

    def _lose(self, current: dict | None) -> CheckpointLockedError:
        root = self.storage.display(self.path.rsplit("/", 1)[0])
        holder = (current or {}).get("holder") or "nobody (the lock record is gone)"
        self.lost = CheckpointLockedError(
            f"this CheckpointManager lost the lock of {root} (its lease expired while it was paused; now "
            f"held by {holder}); it commits and deletes nothing there any more", path=root)
        self._stop.set()
        log.error("%s", self.lost)
        return self.lost

    @staticmethod
    def _stale(record: dict) -> bool:
        renewed = record.get("renewed")
        if record.get("released") or not isinstance(renewed, (int, float)) or wall_clock() - renewed > LEASE_SECONDS:
            return True
        if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
            try:
                os.kill(record["pid"], 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
        return False

    def _refuse(self, record: dict, why: object = None) -> None:
        root = self.storage.display(self.path.rsplit("/", 1)[0])
        holder = record.get("holder") or "an unknown writer"
        detail = f"; {' '.join(str(why).split())}" if why is not None else ""
        raise CheckpointLockedError(f"another CheckpointManager is writing to {root} (lock held by {holder}{detail})",
                                    path=root)

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 4):
            try:
                with self._guard:
                    if self.lost is not None:
                        return
                    self._renew()  # conditional: never over another writer's record
            except CheckpointLockedError:
                return
            except CheckpointError as exc:
                log.warning("could not renew the lock %s: %s", self.storage.display(self.path), exc)

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._thread = None
        if self.lost is not None:
            return
        try:  # only while the record is still this holder's version
            directory = self.path.rsplit("/", 1)[0]
            if self.storage.conditional_deletes(directory):
                self.storage.delete_if(self.path, self.etag)
            else:
                self.storage.write_if(self.path, self._body(released=True), etag=self.etag)
        except CheckpointError as exc:
            log.warning("could not release the lock %s: %s", self.storage.display(self.path), exc)

"""The writer lock of a root on a mount without ``flock`` (object stores): a lease, and its fence.

``.lock`` holds the holder's host, pid, a token and the time it was last renewed; a heartbeat renews
it every quarter of :data:`LEASE_SECONDS` while held. A lock not renewed for :data:`LEASE_SECONDS`,
or held by a dead process on this host, is taken over; after writing its record a taker reads it
back, and once more after :data:`SETTLE_SECONDS`, and is refused when another writer's token is
there (it lost the race): the loser of a race
always gets :class:`~ckpt.errors.CheckpointLockedError` naming the holder, never a bare storage
error. Release removes the record only while it is still this holder's.

The fence (:meth:`LeaseLock.check`): before each commit point and each deletion the holder reads the
record back; when another writer's token is there (this holder was paused past its lease and was
taken over) the lock is lost for good: the heartbeat stops (it never writes over the new holder's
record), and every later check raises :class:`~ckpt.errors.CheckpointLockedError` — nothing more is
committed or deleted by the stale holder. A holder whose own lease expired while nobody took it
renews it (and reads it back) before going on. What is left is the time between the check and the
one PUT that follows it: a holder paused exactly there for a whole lease can still commit once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from ..errors import CheckpointError, CheckpointLockedError, CorruptCheckpointError
from .base import Storage

log = logging.getLogger(__name__)

LEASE_SECONDS = 60.0
SETTLE_SECONDS = 0.3  # a taker reads the record back once more after this long: a racing taker's PUT lands first


class LeaseLock:
    """The writer lock of a root on an object store (see the module docstring); ``release()`` ends it."""

    def __init__(self, storage: Storage, path: str, holder: str):
        self.storage, self.path, self.token = storage, path, uuid.uuid4().hex
        self.record = {"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "token": self.token}
        self.lost: CheckpointLockedError | None = None
        self._guard = threading.Lock()  # the heartbeat and the fence never renew at once
        current = self._read_settled()
        if current is not None and not self._stale(current):
            self._refuse(current)
        self._take()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="ckpt-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        """Write this holder's record and read it back: refused when another writer's is there."""
        try:
            self._renew()
            current = self._read_settled()
        except CheckpointError as exc:  # a racing writer's PUT in between: whoever is there now wins
            current = self._read_settled()
            if current is None or current.get("token") != self.token:
                self._refuse(current or {}, why=exc)
            return
        if current is None or current.get("token") != self.token:  # another writer won the race
            self._refuse(current or {})
        time.sleep(SETTLE_SECONDS)  # a taker that read the old record before this one wrote has written by now
        current = self._read_settled()
        if current is None or current.get("token") != self.token:
            self._refuse(current or {})

    def _read_settled(self) -> dict | None:
        """The record, read again when a concurrent PUT made the first read fail."""
        try:
            return self._read()
        except CheckpointError:
            time.sleep(0.05)
            return self._read()

    def _read(self) -> dict | None:
        directory, name = self.path.rsplit("/", 1)
        try:
            raw = self.storage.read_bytes(directory, name, 1 << 16)
        except CorruptCheckpointError:  # missing
            return None
        try:
            record = json.loads(raw)
            return record if isinstance(record, dict) else {}
        except ValueError:
            return {}

    def _renew(self) -> None:
        self.storage.write_bytes(self.path, json.dumps({**self.record, "renewed": time.time()}).encode())
        self.renewed = time.monotonic()

    def check(self) -> None:
        """The fence: raise :class:`~ckpt.errors.CheckpointLockedError` when this holder no longer
        holds the lease (see the module docstring); renew an expired one that nobody took."""
        with self._guard:
            if self.lost is not None:
                raise self.lost
            current = self._read_settled()
            if current is None or current.get("token") != self.token:
                raise self._lose(current)
            if time.monotonic() - self.renewed > LEASE_SECONDS / 2:  # paused: renewed late, read back
                self._renew()
                current = self._read_settled()
                if current is None or current.get("token") != self.token:
                    raise self._lose(current)

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
        if not isinstance(renewed, (int, float)) or time.time() - renewed > LEASE_SECONDS:
            return True
        if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
            try:
                os.kill(record["pid"], 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
        return False

    def _refuse(self, record: dict, why: BaseException | None = None) -> None:
        root = self.storage.display(self.path.rsplit("/", 1)[0])
        holder = record.get("holder") or "an unknown writer"
        detail = f"; {' '.join(str(why).split())}" if why is not None else ""
        raise CheckpointLockedError(f"another CheckpointManager is writing to {root} (lock held by {holder}{detail})",
                                    path=root)

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 4):
            try:
                self.check()  # renews only while the record is still this holder's
                with self._guard:
                    if self.lost is None:
                        self._renew()
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
        try:
            current = self._read()
            if current is not None and current.get("token") == self.token:
                self.storage.remove(self.path)
        except CheckpointError as exc:
            log.warning("could not release the lock %s: %s", self.storage.display(self.path), exc)

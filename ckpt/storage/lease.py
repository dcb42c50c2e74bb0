"""The writer lock of a root on a mount without ``flock`` (object stores): a lease.

``.lock`` holds the holder's host, pid, a token and the time it was last renewed; a heartbeat renews
it every quarter of :data:`LEASE_SECONDS` while held. A lock not renewed for :data:`LEASE_SECONDS`,
or held by a dead process on this host, is taken over; after writing its record a taker reads it
back and is refused when another writer's token is there (it lost the race). Release removes the
record only while it is still this holder's. The lease is not a fence: a holder paused past the
lease does not know it lost it.
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


class LeaseLock:
    """The writer lock of a root on an object store (see the module docstring); ``release()`` ends it."""

    def __init__(self, storage: Storage, path: str, holder: str):
        self.storage, self.path, self.token = storage, path, uuid.uuid4().hex
        self.record = {"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "token": self.token}
        current = self._read()
        if current is not None and not self._stale(current):
            self._refuse(current)
        self._renew()
        current = self._read()
        if current is None or current.get("token") != self.token:  # another writer won the race
            self._refuse(current or {})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="ckpt-lease", daemon=True)
        self._thread.start()

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

    def _refuse(self, record: dict) -> None:
        root = self.storage.display(self.path.rsplit("/", 1)[0])
        holder = record.get("holder") or "an unknown writer"
        raise CheckpointLockedError(f"another CheckpointManager is writing to {root} (lock held by {holder})",
                                    path=root)

    def _heartbeat(self) -> None:
        while not self._stop.wait(LEASE_SECONDS / 4):
            try:
                self._renew()
            except CheckpointError as exc:
                log.warning("could not renew the lock %s: %s", self.storage.display(self.path), exc)

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=30)
        try:
            current = self._read()
            if current is not None and current.get("token") == self.token:
                self.storage.remove(self.path)
        except CheckpointError as exc:
            log.warning("could not release the lock %s: %s", self.storage.display(self.path), exc)

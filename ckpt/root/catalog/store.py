"""The catalog: a local LMDB index of a run's steps across its mounts. A cache — the manifests on the
mounts are the truth; :func:`open_catalog` rebuilds it from them whenever it is missing, unreadable,
of another schema version, or disagrees with the primary's listing.

    catalog = open_catalog(Catalog.default_path(primary), [primary, replica])
    catalog.record_commit(str(primary), 100, manifest)       # the manager, after a commit
    catalog.set_state(str(replica), 100, ReplicaState.COPYING)  # replication, as it goes
    for info in catalog.steps(): print(info.step, info.kind, info.mounts)

Records are JSON (utf-8) values in LMDB's main database (schema :data:`SCHEMA_VERSION`), each
preceded by the CRC-32 of its key and body (a damaged record that still parses is found):

    meta/schema              {"version": 2}
    meta/mounts              ["<primary url>", "<replica url>", ...]
    step/<step:012d>         {"kind", "base_step", "bytes", "raw_bytes", "tensors", "created"}
    mount/<url>/<step:012d>  {"state", "when", "detail"}     state: a ReplicaState (:data:`STATES`)
    chunks/<step:012d>       [[key, [offsets...], file, checksum], ...]   every tensor chunk

``bytes`` is the sum of the stored lengths of every blob (tensor chunks and values), ``raw_bytes``
the same decoded. The step record and chunk checksums are the primary's where the primary has the
step (data file names differ between mounts on object stores; checksums do not). A mount is named
by its display name (:attr:`~ckpt.storage.Location.display_name`: an absolute path for a local mount,
else its URL), which never holds credentials; a URL given as text has any ``user:password@`` removed.

Concurrency: every public write is one LMDB write transaction, so readers (other threads, other
processes) see a call's records whole or not at all and never block the writer (LMDB MVCC; the
environment is opened with ``lock=True``, which registers readers so pages they still see are not
reused). Writers within one process are serialised by a :class:`threading.Lock` held for the whole
transaction (LMDB's own writer mutex serialises processes). Manifests are read before a rebuild's
transaction begins, so the lock is never held across mount I/O.

Opening: the directory and its files are checked first (:mod:`ckpt.root.catalog.files`: a real
directory of regular files, never a symlink followed; ``data.mdb`` as long as its meta pages say), and
:func:`open_catalog` reads every record; any damage is discarded and rebuilt, never followed.
Nothing does I/O by the catalog: the mounts a caller lists come from its own configuration.

Every LMDB failure is raised as :class:`~ckpt.errors.CheckpointError`; a damaged record or an
invalid LMDB file as :class:`~ckpt.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager

import lmdb

from ...read.committed import read_manifest
from ...errors import CheckpointError, CorruptCheckpointError
from ...format import Manifest
from ...redact import redact
from ...storage import Location
from .files import DAMAGE, discard, open_env
from .records import (ACTIVE_STATES, DIR_NAME, MOUNTS_KEY, SCHEMA_KEY, SCHEMA_VERSION, STATES, UNREADABLE,
                               MountState, StepInfo, chunk_records, chunks_key, decode, encode, mount_id, mount_key,
                               mount_state, step_info, step_key, step_record)
from ..answer import REPLICA_WAIT_S, primary_then_replicas
from ..replica_states import ReplicaState
from ..steps import CheckpointRoot

__all__ = ["Catalog", "open_catalog", "MountState", "StepInfo", "mount_id", "STATES", "ACTIVE_STATES",
           "SCHEMA_VERSION", "DIR_NAME"]

log = logging.getLogger(__name__)

def _put(txn, key: bytes, doc) -> None:
    txn.put(key, encode(key, doc))


def _error(path: str, what: str, exc: BaseException) -> CheckpointError:
    kind = CorruptCheckpointError if isinstance(exc, DAMAGE) else CheckpointError
    return kind(f"{what} the catalog {path} failed: {exc}", path=path)


class Catalog:
    """The LMDB environment in the local directory ``path`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False):
        self.path = os.fspath(path)
        self.readonly = readonly
        self._write_lock = threading.Lock()
        self.created = False  # this call made a new, empty catalog
        try:
            self._env = open_env(self.path, readonly)
        except (lmdb.Error, OSError) as exc:
            raise _error(self.path, "opening", exc) from None
        try:
            version = self._get(SCHEMA_KEY)
            if version is None and not readonly:
                with self._write() as txn:
                    if txn.get(SCHEMA_KEY) is None:
                        _put(txn, SCHEMA_KEY, {"version": SCHEMA_VERSION})
                        self.created = True
                version = {"version": SCHEMA_VERSION}
            if version is None:
                raise CheckpointError(f"{self.path} holds no catalog", path=self.path)
            if not isinstance(version, dict) or version.get("version") != SCHEMA_VERSION:
                raise CorruptCheckpointError(f"catalog {self.path} has schema {version!r}; this build reads "
                                             f"version {SCHEMA_VERSION}", path=self.path)
        except BaseException:
            self._env.close()
            raise

    @staticmethod
    def default_path(primary: Location) -> str | None:
        """``<primary>/.catalog`` for a local primary; None for a URL (configure a local path)."""
        return os.path.join(primary.display_name, DIR_NAME) if primary.is_local else None

    # -- LMDB plumbing -------------------------------------------------------------------------
    @contextmanager
    def _write(self):
        if self.readonly:
            raise CheckpointError(f"catalog {self.path} is open read-only", path=self.path)
        with self._write_lock:
            try:
                with self._env.begin(write=True) as txn:
                    yield txn
            except lmdb.Error as exc:
                raise _error(self.path, "writing", exc) from None

    @contextmanager
    def _read(self):
        try:
            with self._env.begin() as txn:
                yield txn
        except lmdb.Error as exc:
            raise _error(self.path, "reading", exc) from None

    def _decode(self, key: bytes, raw: bytes | None):
        return decode(self.path, key, raw)

    def _get(self, key: bytes):
        with self._read() as txn:
            return self._decode(key, txn.get(key))

    def _scan(self, txn, prefix: bytes):
        cursor = txn.cursor()
        if cursor.set_range(prefix):
            for key, value in cursor:
                if not key.startswith(prefix):
                    break
                yield bytes(key), self._decode(key, value)

    def check_records(self) -> None:
        """Every record decodes (its checksum holds) and the mount list and step records parse."""
        with self._read() as txn:
            for _key, _doc in self._scan(txn, b""):
                pass
        self.mounts()
        self.steps()

    # -- mounts --------------------------------------------------------------------------------
    def set_mounts(self, urls: list) -> None:
        """The run's mounts, primary first (URLs, paths or Locations)."""
        with self._write() as txn:
            _put(txn, MOUNTS_KEY, [mount_id(u) for u in urls])

    def mounts(self) -> list[str]:
        found = self._get(MOUNTS_KEY) or []
        if not isinstance(found, list) or not all(isinstance(u, str) for u in found):
            raise CorruptCheckpointError(f"catalog {self.path}: bad mount list", path=self.path)
        return found

    # -- writes --------------------------------------------------------------------------------
    def record_commit(self, mount, step: int, manifest: Manifest, when: float | None = None) -> None:
        """``step`` was committed on ``mount``: its record, chunk checksums and mount state, at once."""
        mount = mount_id(mount)
        with self._write() as txn:
            self._put_commit(txn, mount, step, manifest, time.time() if when is None else when)

    def _put_commit(self, txn, mount: str, step: int, manifest: Manifest, when: float) -> None:
        primary = (self._decode(MOUNTS_KEY, txn.get(MOUNTS_KEY)) or [None])[0]
        if mount == primary or txn.get(step_key(step)) is None:
            _put(txn, step_key(step), step_record(manifest))
            _put(txn, chunks_key(step), chunk_records(manifest))
        _put(txn, mount_key(mount, step), {"state": ReplicaState.COMMITTED.value, "when": when, "detail": ""})

    def set_state(self, mount, step: int, state: ReplicaState | str, when: float | None = None,
                  detail: str = "") -> None:
        if state not in STATES:
            raise ValueError(f"catalog state {state!r} is not one of {', '.join(STATES)}")
        with self._write() as txn:
            _put(txn, mount_key(mount_id(mount), step),
                 {"state": ReplicaState(state).value, "when": time.time() if when is None else when,
                  "detail": redact(detail)})

    def forget(self, mount, step: int) -> None:
        """``step`` was deleted on ``mount``; when no mount still has it (or is copying it), the
        step's records go too."""
        mount = mount_id(mount)
        with self._write() as txn:
            txn.delete(mount_key(mount, step))
            states = self._mount_states(txn).get(step, {})
            if not any(s.state in ACTIVE_STATES for s in states.values()):
                for url in states:
                    txn.delete(mount_key(url, step))
                txn.delete(step_key(step))
                txn.delete(chunks_key(step))

    # -- reads ---------------------------------------------------------------------------------
    def _mount_states(self, txn) -> dict[int, dict[str, MountState]]:
        found: dict[int, dict[str, MountState]] = {}
        for key, doc in self._scan(txn, b"mount/"):
            url, step, state = mount_state(self.path, key, doc)
            found.setdefault(step, {})[url] = state
        return found

    def steps(self) -> list[StepInfo]:
        """Every step with a record or a mount state, ascending."""
        with self._read() as txn:
            states = self._mount_states(txn)
            records = {}
            for key, doc in self._scan(txn, b"step/"):
                try:
                    records[int(key[len(b"step/"):])] = doc
                except ValueError:
                    raise CorruptCheckpointError(f"catalog {self.path}: bad key {key!r}", path=self.path) from None
        return [step_info(self.path, step, records.get(step), states.get(step, {}))
                for step in sorted(states.keys() | records.keys())]

    def step(self, step: int) -> StepInfo | None:
        with self._read() as txn:
            doc = self._decode(step_key(step), txn.get(step_key(step)))
            states = self._mount_states(txn).get(step, {})
        return None if doc is None and not states else step_info(self.path, step, doc, states)

    def checksums(self, step: int) -> dict[tuple[str, tuple[int, ...]], str]:
        """``{(tensor key, chunk offsets): checksum}`` of the step's chunks (empty when unknown)."""
        records = self._get(chunks_key(step)) or []
        try:
            return {(key, tuple(offsets)): digest for key, offsets, _file, digest in records}
        except (TypeError, ValueError):
            raise CorruptCheckpointError(f"catalog {self.path}: bad chunk records for step {step}",
                                         path=self.path) from None

    # -- the truth -----------------------------------------------------------------------------
    def rebuild(self, mounts: list[Location]) -> None:
        """Replace everything with what the mounts hold (primary first): every committed step's
        manifest is read (an unreadable one is recorded "failed" with the error), then the whole
        catalog is swapped in one transaction. A replica that cannot be listed is left out with a
        warning; the primary's listing failing raises."""
        found = []  # (mount, step, manifest or error text)
        # replicas listed on threads while the primary is: one that does not answer in time is left out like
        # one that cannot be listed (a cache: the replicator reports their steps again as it copies)
        listed = primary_then_replicas(CheckpointRoot(mounts[0]).committed,
                                       [CheckpointRoot(location).committed for location in mounts[1:]],
                                       wait_all=lambda _: False)
        for index, location in enumerate(mounts):
            root = CheckpointRoot(location)
            done, committed, error = (True, listed[0], None) if index == 0 else listed[1][index - 1]
            if not done:
                log.warning("catalog rebuild: %s has not answered %.0f s after the primary; its states are left out",
                            location, REPLICA_WAIT_S)
                continue
            if error is not None:
                log.warning("catalog rebuild: cannot list %s (%s); its states are left out", location, error)
                continue
            for step in committed:
                try:
                    found.append((mount_id(location), step, read_manifest(root.step_path(step))))
                except CheckpointError as exc:
                    found.append((mount_id(location), step, " ".join(str(exc).split())))
        now = time.time()
        with self._write() as txn:
            with txn.cursor() as cursor:
                keys = [bytes(key) for key in cursor.iternext(values=False)]
            for key in keys:
                if key != SCHEMA_KEY:
                    txn.delete(key)
            _put(txn, MOUNTS_KEY, [mount_id(m) for m in mounts])
            for mount, step, manifest in found:
                if isinstance(manifest, Manifest):
                    self._put_commit(txn, mount, step, manifest, manifest.created or now)
                else:
                    _put(txn, mount_key(mount, step), {"state": ReplicaState.FAILED.value, "when": now,
                                                             "detail": UNREADABLE + manifest})

    def listed_on(self, mount) -> set[int]:
        """Steps the catalog believes ``mount`` lists: committed, or committed but unreadable."""
        mount = mount_id(mount)
        return {step for step, states in self._mount_states_now().items()
                if mount in states and (states[mount].state is ReplicaState.COMMITTED
                                        or states[mount].detail.startswith(UNREADABLE))}

    def _mount_states_now(self):
        with self._read() as txn:
            return self._mount_states(txn)

    def is_consistent_with(self, primary: Location) -> bool:
        """Whether the steps recorded on ``primary`` are exactly those it lists (no manifest read)."""
        return self.listed_on(primary) == set(CheckpointRoot(primary).committed())

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> "Catalog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_catalog(path: str | os.PathLike, mounts: list[Location], *, rebuild: bool = False) -> Catalog:
    """The catalog at ``path`` for ``mounts`` (primary first), rebuilt from the manifests when it is
    new, unreadable (its LMDB files are then deleted, with a warning), of another schema, inconsistent
    with the primary's listing, or when ``rebuild`` asks; its mount list set to ``mounts``."""
    path = os.fspath(path)
    try:
        catalog = Catalog(path)
        try:
            catalog.check_records()
        except BaseException:
            catalog.close()
            raise
    except CorruptCheckpointError as exc:
        log.warning("catalog %s is unreadable (%s); rebuilding it from the manifests", path, exc)
        discard(path)
        catalog = Catalog(path)
    try:
        if (rebuild or catalog.created or [mount_id(m) for m in mounts] != catalog.mounts()
                or not catalog.is_consistent_with(mounts[0])):
            catalog.rebuild(mounts)
    except BaseException:
        catalog.close()
        raise
    return catalog

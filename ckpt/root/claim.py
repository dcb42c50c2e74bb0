"""Which run a mount belongs to: the run identity, created when a run first claims its primary root,
kept beside the steps and recorded in each step's manifest (``run``, docs/FORMAT.md).

    <mount>/.run      {"run": "<32 hex>", "primary": "<the primary's mount id>", "created": <unix time>}

A run claims every mount it writes, with the same lock (``.lock``: flock, or a lease on object
stores) and then this record: the primary when the manager locks it (:func:`claim_primary`), each
replica lazily, by its worker, before the first copy (:func:`claim_replica`: a replica that is down
never blocks start-up). A mount without a record, whose committed steps name no other run, becomes
this run's; a mount claimed by another run, or holding another run's steps, is refused with
:class:`~ckpt.errors.ForeignRunError` (one line naming both runs) and nothing is written there.

The identity survives the loss of the primary: a primary with neither a record nor committed steps
takes it from a replica whose record names this very primary (the run that lost its primary,
restarting), never from a replica that names another primary; a primary whose record alone was lost
takes its newest step's. Otherwise a new identity is made.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, ForeignRunError
from ..format import is_run_id
from ..storage import Location
from .answer import Answer

log = logging.getLogger(__name__)

RUN_NAME = ".run"
ADOPT_TIMEOUT = 10.0  # seconds a fresh primary waits for its replicas' records, at most


def new_run_id() -> str:
    return uuid.uuid4().hex


def read_claim(mount: Location) -> dict | None:
    """The mount's record (``run``, ``primary``), or None when it has none; a record that cannot be
    read as one is refused (nobody can tell whose the mount is)."""
    try:
        raw = mount.storage.read_bytes(mount.path, RUN_NAME, 1 << 12)
    except (CorruptCheckpointError, CheckpointNotFoundError):  # missing, or the mount's directory not made yet
        return None
    except ValueError:  # larger than any record
        raw = b""
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not is_run_id(record.get("run")):
        raise ForeignRunError(f"{mount}/{RUN_NAME} is not a run record; cannot tell which run {mount} belongs "
                              "to, not writing there", path=str(mount))
    return record


def write_claim(mount: Location, run: str, primary: str) -> None:
    record = {"run": run, "primary": primary, "created": time.time()}
    mount.storage.write_bytes((mount / RUN_NAME).path, json.dumps(record).encode())


def foreign(mount: Location, theirs: str, ours: str, what: str = "") -> ForeignRunError:
    """The one line refusing ``mount``: it belongs to run ``theirs``, this is run ``ours``."""
    return ForeignRunError(f"{mount} belongs to another run ({what or 'claimed by'} run {theirs}; this is run "
                           f"{ours}); not writing there", path=str(mount))


def claim_primary(root, replicas: list) -> str:
    """The run identity of the primary ``root`` (a locked :class:`~ckpt.root.steps.CheckpointRoot`;
    ``replicas``: the others), claimed (see the module docstring)."""
    record = read_claim(root.path)
    if record is not None:
        return record["run"]
    committed = root.committed()
    runs = [run for run in root.runs(committed).values() if isinstance(run, str)]
    run = runs[-1] if runs else None
    if run is not None:
        log.warning("checkpoint root %s lost its %s record; it keeps the run of its newest step (%s)",
                    root.path, RUN_NAME, run)
    elif not committed:
        run = _adopt(root.path.display_name, [replica.path for replica in replicas])
    run = run or new_run_id()
    write_claim(root.path, run, root.path.display_name)
    return run


def _adopt(primary: str, replicas: list[Location]) -> str | None:
    """The run of the first replica whose record names ``primary`` (read in the background, for at
    most :data:`ADOPT_TIMEOUT` seconds: a replica that is down is passed over)."""
    def look() -> str | None:
        for replica in replicas:
            try:
                record = read_claim(replica)
            except (CheckpointError, OSError):
                continue
            if record is not None and record.get("primary") == primary:
                log.warning("checkpoint root %s is empty and unclaimed; replica %s names it as its primary: "
                            "continuing run %s", primary, replica, record["run"])
                return record["run"]
        return None

    done, run = Answer(look, name="ckpt-run-adopt").wait(time.monotonic() + ADOPT_TIMEOUT)
    return run if done else None


def claim_replica(mount, run: str, primary: str) -> None:
    """Claim the replica ``mount`` (a locked :class:`~ckpt.root.steps.CheckpointRoot`) for ``run``
    whose primary is ``primary``, or raise :class:`~ckpt.errors.ForeignRunError`."""
    record = read_claim(mount.path)
    if record is not None:
        if record["run"] != run:
            raise foreign(mount.path, record["run"], run)
        return
    committed = mount.committed()
    others = sorted({r for r in mount.runs(committed).values() if isinstance(r, str) and r != run})
    if others:
        raise foreign(mount.path, ", ".join(others), run, what="its steps were written by")
    write_claim(mount.path, run, primary)

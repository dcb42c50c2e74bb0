"""One node's memory directory for one run (the memory tier, issue 38), on a local file system (tmpfs).

    <directory>/                 made 0700 when made here; a link, a non-directory or another user's is refused
      <run>/                     NodeStore.path: 0700 and this user's, else refused; the only directory
                                 ever listed or changed (another run's beside it is never touched)
        step-00000012/           made before any rank writes into it (prepare_step)
          rank-00000/            a committed rank checkpoint (ckpt.save: our commit protocol, tmp + rename)
          rank-00000.tmp-<id>/   a rank's write in progress, or a dead one: never counted
          COMPLETE               JSON {"run", "step", "node", "ranks", "local_world"}, at most 64 KiB,
                                 written last and atomically (tmp + fsync + rename + directory fsync);
                                 "local_world" (ranks per node: which ranks are the node's own, which
                                 its partner's copies) is optional: a record without it still reads
        <anything else>          never listed, never deleted (except by remove_all)

The invariant: a step directory holding a valid COMPLETE (naming this run and this step) holds every
rank it lists, committed. COMPLETE is written only once they are (:meth:`NodeStore.mark_complete`
checks) and is removed before any of them (:meth:`NodeStore.remove_step`), so a crash at any point
leaves either a whole step or one without COMPLETE, which is never listed and which start-up removes
(:meth:`NodeStore.remove_incomplete`). Names are parsed strictly (``step-`` and 8 or more digits,
``rank-`` and 5 or more, exactly as made); a link in place of a directory is never listed, followed
or removed through.
COMPLETE is read bounded, without following a link, and checked field by field before use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from .. import commit
from ..errors import (CheckpointError, CheckpointNotFoundError, CheckpointWriteError, InvalidOptionError,
                      StorageError, UnsafeCheckpointError)
from ..format import attempt_name, is_leftover, is_run_id, leftover_target, parse_step_name, step_name
from ..storage import Location, locate

log = logging.getLogger(__name__)

COMPLETE_NAME = "COMPLETE"
MAX_COMPLETE_BYTES = 64 << 10
PRIVATE_MODE = 0o700
_RANK_DIR = re.compile(r"rank-(\d{5,})")
_COMPLETE_KEYS = {"run", "step", "node", "ranks"}
_OPTIONAL_KEYS = {"local_world"}


def rank_name(rank: int) -> str:
    """The directory name of a rank's checkpoint in a memory step: ``rank-00003``."""
    return f"rank-{rank:05d}"


def parse_rank_name(name: str) -> int | None:
    """The rank of a rank directory's name (``rank-00003`` -> 3), None for any other name."""
    match = _RANK_DIR.fullmatch(name)
    return int(match.group(1)) if match and rank_name(int(match.group(1))) == name else None


def _is_count(value) -> bool:
    return type(value) is int and value >= 0  # not a bool, not a float


def _is_per_node(value) -> bool:
    return _is_count(value) and value > 0


def _is_real_dir(path: Path) -> bool:
    """A directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _remove_tree(path: Path) -> None:
    """Remove ``path`` and what is below it, links unfollowed (shutil's fd-based walk); an entry gone
    meanwhile is fine, any other failure is raised."""
    def failed(_function, where, info):
        error = info[1]
        if not isinstance(error, FileNotFoundError):
            raise StorageError(f"removing {where} failed: {error}", path=str(path)) from None

    shutil.rmtree(path, onerror=failed)


def _check_private(path: Path, what: str, *, private_mode: bool) -> None:
    """Refuse ``path`` unless it is a directory (not a link) of this user's (and, with
    ``private_mode``, open to nobody else)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{what} {path} does not exist", path=str(path)) from None
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.geteuid():
        problem = f"belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    elif private_mode and stat.S_IMODE(info.st_mode) & 0o077:
        problem = f"is open to other users (mode {stat.S_IMODE(info.st_mode):04o}; expected 0700)"
    if problem is not None:
        raise UnsafeCheckpointError(f"{what} {path} {problem}; refused", path=str(path))


def _make_private(path: Path, storage) -> None:
    """Create the directory ``path`` with mode 0700, its entry fsync'd in its parent; nothing when
    something is there already (checked by the caller)."""
    try:
        os.mkdir(path, PRIVATE_MODE)
    except FileExistsError:
        return
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"cannot create {path}: {path.parent} does not exist", path=str(path)) from None
    storage.sync_dir(str(path.parent))


class NodeStore:
    """The memory steps of ``run`` on this node, under ``<directory>/<run>`` (see the module docstring).

    ``create=False`` opens an existing one only (a tool reading it; missing: CheckpointNotFoundError)."""

    def __init__(self, directory: str | os.PathLike, run: str, *, node: int = 0, create: bool = True):
        if not is_run_id(run):
            raise InvalidOptionError("run", run, "a run id: 1 to 64 of A-Z a-z 0-9 . _ -, not starting with . _ -")
        if not _is_count(node):
            raise InvalidOptionError("node", node, "a node number, 0 or more")
        directory = Path(os.path.abspath(directory))
        self.run, self.node = run, node
        self.path = directory / run
        self.location = locate(str(self.path))  # the door: every Location below is made from it
        storage = self.location.storage
        if create:
            _make_private(directory, storage)
        _check_private(directory, "the memory directory", private_mode=False)
        if create:
            _make_private(self.path, storage)
        _check_private(self.path, "the run's memory directory", private_mode=True)

    # -- names ---------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.path / step_name(step)

    def rank_location(self, step: int, rank: int) -> Location:
        """Where ``rank``'s checkpoint of ``step`` goes (``ckpt.save(state, location, no_dist=True)``)."""
        if not _is_count(rank):
            raise InvalidOptionError("rank", rank, "a rank, 0 or more")
        return self.location / step_name(step) / rank_name(rank)

    def _steps(self) -> list[int]:
        """The steps that have a directory (a real one, named exactly as made), complete or not, ascending."""
        steps = {parse_step_name(name) for name in self.location.list()}  # checked below under its own name
        return sorted(step for step in steps if step is not None and _is_real_dir(self.step_dir(step)))

    # -- writing a step ------------------------------------------------------------------------
    def prepare_step(self, step: int) -> None:
        """Make ``step``'s directory (durably) before any rank writes into it; one there is kept (every rank calls it)."""
        commit.make_directory(self.location / step_name(step))
        if not _is_real_dir(self.step_dir(step)):
            raise UnsafeCheckpointError(f"{self.step_dir(step)} is not a directory of its own; refused",
                                        path=str(self.step_dir(step)))

    def free_bytes(self) -> int:
        """Bytes this user may still write in the run's directory's file system."""
        info = os.statvfs(self.path)
        return info.f_bavail * info.f_frsize

    def committed_ranks(self, step: int) -> set[int]:
        """Ranks of ``step`` whose checkpoint is committed (a write in progress or dead is not)."""
        step_dir, where = self.step_dir(step), self.location / step_name(step)
        if not _is_real_dir(step_dir):
            return set()
        ranks = set()
        for name in where.list():
            rank = parse_rank_name(name)
            if rank is not None and _is_real_dir(step_dir / name) and commit.is_committed(where / name):
                ranks.add(rank)
        return ranks

    def mark_complete(self, step: int, ranks: Iterable[int], *, local_world: int | None = None) -> None:
        """Write ``step``'s COMPLETE listing ``ranks`` (each committed, else refused), atomically;
        ``local_world`` (ranks per node) recorded when given."""
        ranks = sorted(set(ranks))
        if not ranks or not all(_is_count(rank) for rank in ranks):
            raise InvalidOptionError("ranks", ranks, "one or more ranks, each 0 or more")
        if local_world is not None and not _is_per_node(local_world):
            raise InvalidOptionError("local_world", local_world, "ranks per node, 1 or more")
        missing = set(ranks) - self.committed_ranks(step)
        if missing:
            raise CheckpointWriteError(f"{self.step_dir(step)}: rank(s) {sorted(missing)} not committed; "
                                       f"{COMPLETE_NAME} not written", path=str(self.step_dir(step)))
        record = {"run": self.run, "step": step, "node": self.node, "ranks": ranks}
        if local_world is not None:
            record["local_world"] = local_world
        raw = json.dumps(record).encode()
        if len(raw) > MAX_COMPLETE_BYTES:
            raise CheckpointWriteError(f"{COMPLETE_NAME} of {len(ranks)} ranks would exceed {MAX_COMPLETE_BYTES} "
                                       "bytes; not written", path=str(self.step_dir(step)))
        step_dir = self.location / step_name(step)
        storage, tmp = step_dir.storage, step_dir / attempt_name(COMPLETE_NAME, commit.new_tag())
        try:
            storage.write_bytes(tmp.path, raw)  # fsync'd
            storage.rename(tmp.path, (step_dir / COMPLETE_NAME).path)
        except BaseException:
            storage.remove(tmp.path)
            raise
        storage.sync_dir(step_dir.path)

    # -- reading -------------------------------------------------------------------------------
    def _record(self, step: int) -> dict | None:
        """``step``'s COMPLETE, when there is a valid one naming this run and ``step``."""
        where = self.location / step_name(step)
        if not os.path.lexists(self.step_dir(step) / COMPLETE_NAME):
            return None  # a step being written, or one whose removal began
        try:
            raw = where.storage.read_bytes(where.path, COMPLETE_NAME, MAX_COMPLETE_BYTES)
        except (CheckpointError, ValueError, OSError) as exc:  # a link, not a file, too large, unreadable
            log.warning("ignoring %s of %s: %s", COMPLETE_NAME, where, exc)
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and _COMPLETE_KEYS <= set(record) <= _COMPLETE_KEYS | _OPTIONAL_KEYS
                and record["run"] == self.run
                and _is_count(record["step"]) and record["step"] == step and _is_count(record["node"])
                and isinstance(record["ranks"], list) and all(_is_count(rank) for rank in record["ranks"])
                and len(set(record["ranks"])) == len(record["ranks"])
                and _is_per_node(record.get("local_world", 1))):
            log.warning("ignoring %s of %s: not a record of run %s, step %d", COMPLETE_NAME, where, self.run, step)
            return None
        return record

    def _records(self) -> dict[int, dict]:
        return {step: record for step in self._steps() if (record := self._record(step)) is not None}

    def complete_steps(self) -> dict[int, set[int]]:
        """Step -> the ranks its COMPLETE lists that are committed (all of them, unless something
        outside this store removed one), for every step with a valid COMPLETE."""
        return {step: set(record["ranks"]) & self.committed_ranks(step) for step, record in self._records().items()}

    def describe(self) -> list[dict]:
        """The complete steps, oldest first, for ``ckpt inspect``: step, node, ranks, bytes (of those
        ranks), local_world (None when the record has none)."""
        described = []
        for step, record in self._records().items():
            ranks = sorted(set(record["ranks"]) & self.committed_ranks(step))
            size = sum(_tree_bytes(self.step_dir(step) / rank_name(rank)) for rank in ranks)
            described.append({"step": step, "node": record["node"], "ranks": ranks, "bytes": size,
                              "local_world": record.get("local_world")})
        return described

    # -- removing ------------------------------------------------------------------------------
    def remove_step(self, step: int) -> None:
        """Remove ``step``: its COMPLETE first (durably), then its rank directories."""
        step_dir = self.step_dir(step)
        if not _is_real_dir(step_dir):
            return  # gone, or not a step directory of ours: left alone
        complete = step_dir / COMPLETE_NAME
        if os.path.lexists(complete) and not _is_real_dir(complete):
            os.unlink(complete)
            self.location.storage.sync_dir(str(step_dir))
        _remove_tree(step_dir)
        self.location.storage.sync_dir(str(self.path))

    def remove_incomplete(self) -> list[int]:
        """Start-up clean-up, before any rank of the node writes: remove every step directory
        without a valid COMPLETE and the commit leftovers (``rank-00001.tmp-<id>``, ``COMPLETE.tmp-<id>``)
        inside the others. Returns the steps removed."""
        removed = []
        for step in self._steps():
            if self._record(step) is None:
                self.remove_step(step)
                removed.append(step)
                continue
            where = self.location / step_name(step)
            targets = {leftover_target(name) for name in where.list() if is_leftover(name)}
            for target in sorted(t for t in targets if t == COMPLETE_NAME or parse_rank_name(t) is not None):
                commit.collect_garbage(where / target)
        return removed

    def retain(self, keep: int, protect: Iterable[int] = ()) -> list[int]:
        """Remove every complete step but the newest ``keep`` and those in ``protect``; steps being
        written (no COMPLETE yet) are not touched. Returns the steps removed."""
        if not _is_count(keep):
            raise InvalidOptionError("memory_keep", keep, "0 or more")
        complete = sorted(self._records(), reverse=True)
        kept = set(complete[:keep]) | set(protect)
        removed = sorted(step for step in complete if step not in kept)
        for step in removed:
            self.remove_step(step)
        return removed

    def remove_after(self, step: int) -> list[int]:
        """Remove every step after ``step``, complete or not (another history's); the steps removed."""
        removed = [later for later in self._steps() if later > step]
        for later in removed:
            self.remove_step(later)
        return removed

    def remove_all(self) -> None:
        """A clean finish: every step removed (each COMPLETE first), then the run's directory."""
        for step in self._steps():
            self.remove_step(step)
        _remove_tree(self.path)
        self.location.storage.sync_dir(str(self.path.parent))


def _tree_bytes(path: Path) -> int:
    """Bytes of the files below ``path`` (links not followed)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def memory_steps(directory: str | os.PathLike, run: str) -> list[dict]:
    """:meth:`NodeStore.describe` of ``<directory>/<run>``, creating nothing: [] when it does not exist."""
    try:
        store = NodeStore(directory, run, create=False)
    except CheckpointNotFoundError:
        return []
    return store.describe()

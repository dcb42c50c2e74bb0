"""The crash-point sweep: every operation boundary of a recorded sequence, every state a crash there can
leave (:mod:`tests.support.crashsim`), and the invariants of the commit protocol checked on each.

    primary = Mount.local(tmp_path / "run")                      # before the recording: its model
    replica = Mount.s3(s3_bucket, "replica")
    with recording(primary.path) as a, recording(replica.root, scheme="s3") as b:
        ...                                                      # saves, overwrites, replication
    result = sweep([primary.recorded(a), replica.recorded(b)], expected, tmp_path / "crash")
    assert not result.violations, result.violations[:3]

At each boundary (before the first operation, after each one; an object-store recursive delete counts
one boundary per object) the states of the mounts are combined (the product of each mount's crash
states: they are written independently), each distinct one is written out once and checked, for every
mount:

1. every step the root lists loads, bitwise equal to one of the contents ``expected`` allows for it
   (for an overwrite: the old or the new one);
2. so again after the start-up clean-up a restarting manager runs (:meth:`CheckpointRoot.clean_up`,
   which puts back a copy an overwrite moved aside);
3. a step that was listed in every crash state of an earlier boundary (durable) is still listed
   after the clean-up, unless its deletion (of its manifest or its directory) had begun: an overwrite
   leaves the old or the new copy, never neither, and nothing else loses a committed step;
4. after the last operation, the steps of ``final`` are listed in every crash state (a save that
   returned is durable).

Every listed step of a replica is checked the same way, so a replica that lists a step whose data is
missing fails 1. :class:`SweepResult` counts boundaries, crash states and distinct states checked.
"""

from __future__ import annotations

import itertools
import posixpath
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ckpt
from ckpt.errors import CheckpointError
from ckpt.format import step_name
from ckpt.root import CheckpointRoot
from ckpt.storage import LocalStorage, Location
from tests.support.crashsim import LocalObjectStore, ObjectModel, PosixModel, materialize


@dataclass
class Mount:
    """One mount of a scenario: its name, its model (taken before the recording) and its recording."""

    name: str
    model: PosixModel | ObjectModel
    path: str = ""  # what to record: a local path, or ``bucket/prefix``
    root: str = ""  # the checkpoint root below it ("" : the same), which may not exist yet
    recording: object = None

    @classmethod
    def local(cls, path: Path, name: str = "primary", root: str = "") -> "Mount":
        path.mkdir(parents=True, exist_ok=True)
        return cls(name, PosixModel.of(path), str(path), root)

    @classmethod
    def s3(cls, bucket, prefix: str, name: str = "primary", root: str = "") -> "Mount":
        from tests.support.s3server import bucket_fs

        path = f"{bucket.name}/{prefix}"
        return cls(name, ObjectModel.of(bucket_fs(bucket), path), path, root)

    @property
    def object_store(self) -> bool:
        return isinstance(self.model, ObjectModel)

    def recorded(self, recording) -> "Mount":
        self.recording = recording
        return self

    def replay_matches(self, bucket=None) -> bool:
        """Whether the recording replayed on the model gives what the mount holds now (nothing the
        engine did there escaped the recording). Call after the sweep (it replays the model)."""
        if self.object_store:
            from tests.support.s3server import bucket_fs

            return self.model.state() == ObjectModel.of(bucket_fs(bucket), self.path).state()
        return self.model.final_state() == PosixModel.of(self.path).final_state()

    def crash_states(self):
        return [self.model.state()] if self.object_store else self.model.crash_states()


@dataclass
class SweepResult:
    operations: int = 0        # recorded operations that change state or list (all mounts)
    boundaries: int = 0        # crash points: before the first operation and after each (sub-)operation
    crash_states: int = 0      # states checked over all boundaries (the same state at two boundaries twice)
    distinct_states: int = 0   # states written out and loaded
    violations: list[str] = field(default_factory=list)


def _loads(location: Location, step: int, allowed: list[dict]) -> str | None:
    """None when the step loads bitwise as one of ``allowed``, else what went wrong."""
    live = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in allowed[0].items()}
    try:
        ckpt.load(live, location / step_name(step))
    except CheckpointError as exc:
        return f"step {step} is listed but does not load: {type(exc).__name__}: {exc}"
    for content in allowed:
        if all(torch.equal(live[k].view(torch.uint8), v.view(torch.uint8)) if isinstance(v, torch.Tensor)
               else live[k] == v for k, v in content.items()):
            return None
    return f"step {step} loads other contents than its saves"


def _check_mount(location: Location, expected: dict[int, list[dict]]) -> tuple[list[str], set[int]]:
    problems = []
    for phase in ("as found", "after clean-up"):
        if phase == "after clean-up":
            CheckpointRoot(location).clean_up()
        listed = CheckpointRoot(location).steps()
        for step in listed:
            if step not in expected:
                problems.append(f"{phase}: step {step} listed, never saved")
                continue
            problem = _loads(location, step, expected[step])
            if problem:
                problems.append(f"{phase}: {problem}")
    return problems, set(listed)


def _deleting(ops, step: int, root: str) -> bool:
    """Whether the deletion of ``step`` (its manifest, or its whole directory) began in ``ops``."""
    name = posixpath.join(root, step_name(step))
    return any((op.kind == "remove" and op.path == f"{name}/manifest.json") or
               (op.kind == "remove_tree" and op.path == name) for op in ops)


def sweep(mounts: list[Mount], expected: dict[str, dict[int, list[dict]]], workdir: Path, *,
          final: dict[str, set[int]] | None = None, stop_at_first: bool = False) -> SweepResult:
    """Check every crash state of every boundary (see the module docstring)."""
    final = final or {}
    ops = sorted(((op.seq, i, op) for i, mount in enumerate(mounts) for op in mount.recording.ops),
                 key=lambda item: item[0])
    result = SweepResult(operations=len(ops))
    verdicts: dict[tuple, tuple[list[str], list[set[int]]]] = {}
    durable: list[set[int]] = [set() for _ in mounts]
    done: list[list] = [[] for _ in mounts]
    current = [m.crash_states() for m in mounts]

    def boundary(where: str, last: bool) -> None:
        result.boundaries += 1
        listed_everywhere = [None] * len(mounts)
        for combined in itertools.product(*current):
            result.crash_states += 1
            if combined not in verdicts:
                verdicts[combined] = _check(mounts, combined, expected, workdir / f"s{len(verdicts)}")
                result.distinct_states += 1
            problems, listed = verdicts[combined]
            result.violations.extend(f"{where}: {p}" for p in problems)
            for i, mount in enumerate(mounts):
                lost = {s for s in durable[i] - listed[i] if not _deleting(done[i], s, mount.root)}
                if lost:
                    result.violations.append(f"{where}: {mount.name} lost committed step(s) {sorted(lost)}")
                if last:
                    missing = final.get(mount.name, set()) - listed[i]
                    if missing:
                        result.violations.append(f"{where}: {mount.name}: step(s) {sorted(missing)} saved "
                                                 "but not durable")
                listed_everywhere[i] = listed[i] if listed_everywhere[i] is None else listed_everywhere[i] & listed[i]
        for i in range(len(mounts)):
            durable[i] |= listed_everywhere[i] or set()

    boundary("before the first operation", last=not ops)
    for n, (_, i, op) in enumerate(ops, 1):
        mount = mounts[i]
        done[i].append(op)
        if mount.object_store:
            parts = mount.model.steps(op)
            for j, objects in enumerate(parts):
                current[i] = [tuple(sorted(objects.items()))]
                boundary(f"{mount.name} after op {n} ({op!r}){f' part {j + 1}' if len(parts) > 1 else ''}",
                         last=n == len(ops) and j == len(parts) - 1)
        else:
            mount.model.apply(op)
            current[i] = mount.model.crash_states()
            boundary(f"{mount.name} after op {n} ({op!r})", last=n == len(ops))
        if stop_at_first and result.violations:
            break
    return result


def _check(mounts, combined, expected, directory: Path) -> tuple[list[str], list[set[int]]]:
    problems, listed = [], []
    try:
        for mount, state in zip(mounts, combined):
            path = materialize(state, directory / mount.name) / mount.root
            storage = LocalObjectStore() if mount.object_store else LocalStorage()
            found, steps = _check_mount(Location(storage, str(path).rstrip("/")), expected.get(mount.name, {}))
            problems.extend(f"{mount.name}: {p}" for p in found)
            listed.append(steps)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return problems, listed

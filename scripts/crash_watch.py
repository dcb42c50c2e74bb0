"""The crash harness's eyes (scripts/crash_harness.py): a running job watched through its folders.

* :func:`run_reference`: the uninterrupted job, watched for its timings (:class:`Profile`: start-up,
  seconds per step, close), which place the uniform kills.
* :func:`drive`: one launch watched until it exits or its kill moment comes, then killed
  (:meth:`Job.kill <scripts.crash_job.Job.kill>`) with a snapshot of the frozen job's folders and
  metrics, from which :func:`classify` names the phase the kill struck in. The kill moment is a
  delay after the start (``uniform``) or a save moment of a step (:data:`AIM_TARGETS`, plus a random
  jitter of at most :data:`AIM_JITTER_S`), seen by polling the folders every :data:`POLL_S`.
* :func:`listing`, :func:`read_metrics`, :func:`unmanifested`: what a folder, ``metrics.jsonl`` and
  a deletion in progress look like from outside, for the checks too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckpt.format import TMP_MARK, is_leftover, step_name, step_of_entry
from scripts.crash_job import Job, Plan, RunPaths

AIM_TARGETS = ("writing", "committed", "replicating", "retention", "replica-retention")
AIM_JITTER_S = {"writing": 0.05, "committed": 0.03, "replicating": 0.03, "retention": 0.0, "replica-retention": 0.0}
POLL_S = 0.001


def listing(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """Step records of ``metrics.jsonl`` and the count of lines that do not parse (a line cut by a
    kill); event records (``{"event": "run_start", ...}``, one per start of the trainer) are skipped."""
    records, bad = [], 0
    try:
        text = path.read_text()
    except OSError:
        return [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if isinstance(record, dict) and "event" in record:
                continue
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError(line)
            records.append(record)
        except ValueError:
            bad += 1
    return records, bad


def unmanifested(folder: Path, names: list[str], known: set[str]) -> list[str]:
    """``step-N`` directories of ``names`` without a manifest (a deletion in progress, or a dead
    one's leftover), except those in ``known``."""
    return [n for n in names if step_of_entry(n) is not None and not is_leftover(n)
            and n not in known and not os.path.exists(folder / n / "manifest.json")]


def classify(snapshot: dict, steps: int, aim: str | None = None) -> str:
    """The phase a kill struck in, from the frozen job's folders and metrics: a save being written
    (a new ``.tmp-`` entry on the primary), a replica copy (on the replica), a step being deleted by
    retention (a ``step-N`` directory whose manifest is gone), several of these; else right after
    a commit (a kill aimed there that found no write in flight: retention, catalog, hand-off to the
    replicator), start-up (no step logged by this launch yet), close (the last step logged) or
    training."""
    parts = [phase for key, phase in (("primary_new_tmp", "save (primary write)"), ("replica_new_tmp", "replica copy"),
                                      ("primary_deleting", "retention (primary delete)"),
                                      ("replica_deleting", "retention (replica delete)")) if snapshot.get(key)]
    if parts:
        return " + ".join(parts)
    if aim == "committed":
        return "after commit"
    if snapshot["logged_this_launch"] == 0:
        return "start-up"
    if snapshot["last_logged"] is not None and snapshot["last_logged"] >= steps:
        return "close"
    return "training"


@dataclass
class Launch:
    """What one launch did."""

    index: int
    resumable: int | None  # the newest step listed on the primary when it started
    outcome: str = ""  # "killed" or "exited"
    exit_code: int | None = None
    seconds: float = 0.0
    resumed_from: int | None = None  # as its log says
    aim: str | None = None
    target_step: int | None = None
    delay_s: float | None = None
    kill: dict = field(default_factory=dict)
    snapshot: dict = field(default_factory=dict)


def _resumed_from(output: str) -> int | None:
    for line in output.splitlines():
        if line.startswith("resumed from checkpoint step "):
            with contextlib.suppress(ValueError):
                return int(line.split()[4])
    return None


class _Before:
    """The folders and metrics as a launch found them: a kill's snapshot reports only what is new."""

    def __init__(self, paths: RunPaths):
        self.paths = paths
        self.names = {mount: set(listing(folder)) for mount, folder in paths.mounts().items()}
        # step directories already without a manifest (dead deletions)
        self.unmanifested = {mount: set(unmanifested(folder, sorted(self.names[mount]), set()))
                             for mount, folder in paths.mounts().items()}
        self.metrics_lines = len(read_metrics(paths.metrics)[0])

    def new_names(self, mount: str) -> list[str]:
        return [n for n in listing(self.paths.mounts()[mount]) if n not in self.names[mount]]

    def deleting(self, mount: str, names: list[str] | None = None) -> list[str]:
        folder = self.paths.mounts()[mount]
        return unmanifested(folder, listing(folder) if names is None else names, self.unmanifested[mount])

    def snapshot(self, job: Job) -> dict:
        records = read_metrics(self.paths.metrics)[0]
        names = {mount: listing(folder) for mount, folder in self.paths.mounts().items()}
        return {
            "at_s": round(job.elapsed(), 3),
            **names,
            **{f"{mount}_new_tmp": [n for n in names[mount] if TMP_MARK in n and n not in self.names[mount]]
               for mount in names},
            **{f"{mount}_deleting": self.deleting(mount, names[mount]) for mount in names},
            "logged_this_launch": len(records) - self.metrics_lines,
            "last_logged": records[-1]["step"] if records else None,
        }


def _aim_seen(before: _Before, aim: str, prefix: str) -> bool:
    """Whether the save moment ``aim`` of the step named ``prefix`` is under way now."""
    mount = "replica" if aim.startswith("replica") else "primary"
    if aim.endswith("retention"):  # a step being deleted: its manifest is removed first
        return bool(before.deleting(mount))
    names = before.new_names(mount)
    if aim == "committed":
        return prefix in names
    return any(n.startswith(prefix + TMP_MARK) for n in names)  # a new attempt, not a dead one's leftover


def drive(job: Job, paths: RunPaths, plan: Plan, launch: Launch, *, delay: float | None = None,
          aim: str | None = None, target_step: int | None = None, rng: random.Random | None = None) -> Launch:
    """Watch ``job`` until it exits or the kill condition holds, then kill it. ``delay``: kill that
    many seconds after the start; ``aim``/``target_step``: kill when the save moment ``aim`` of
    ``target_step`` is seen (plus a random jitter); neither: wait for the exit."""
    before = _Before(paths)
    deadline = job.started + plan.launch_timeout
    fire_at = None if delay is None else job.started + delay
    prefix = None if target_step is None else step_name(target_step)
    while True:
        code = job.poll()
        if code is not None:
            launch.outcome, launch.exit_code = "exited", code
            break
        now = time.monotonic()
        if now > deadline:
            launch.outcome = "timeout"
            job.kill()
            break
        if aim is not None and fire_at is None and _aim_seen(before, aim, prefix):
            jitter = (rng or random).uniform(0.0, AIM_JITTER_S[aim])
            fire_at = now + jitter
            launch.delay_s = now + jitter - job.started
        if fire_at is not None and now >= fire_at:
            launch.snapshot, launch.kill = job.kill(lambda: before.snapshot(job))
            launch.outcome = "killed"
            if launch.delay_s is None:
                launch.delay_s = round(delay, 3)
            break
        if fire_at is not None:
            time.sleep(min(0.005, max(0.0, fire_at - now)))
        else:
            time.sleep(POLL_S if aim is not None else 0.02)
    launch.seconds = round(job.elapsed(), 3)
    launch.resumed_from = _resumed_from(job.output())
    launch.aim, launch.target_step = aim or ("uniform" if delay is not None else None), target_step
    if launch.delay_s is not None:
        launch.delay_s = round(launch.delay_s, 3)
    return launch


@dataclass
class Profile:
    """The reference launch's timings, which place uniform kills."""

    startup_s: float  # start to the first step's metrics line
    step_s: float  # per further step
    close_s: float  # last step's line to exit
    total_s: float

    def expected(self, remaining_steps: int) -> float:
        return self.startup_s + max(0, remaining_steps - 1) * self.step_s + self.close_s


def run_reference(plan: Plan, paths: RunPaths) -> tuple[Profile, Launch]:
    """The uninterrupted job, watched for its timings."""
    job = Job(plan, paths, paths.logs / "reference.log")
    deadline = job.started + plan.launch_timeout
    seen, first, last = 0, None, None
    try:
        while job.poll() is None:
            if time.monotonic() > deadline:
                job.kill()
                raise RuntimeError(f"the reference run did not finish in {plan.launch_timeout} s:\n"
                                   f"{job.output()[-4000:]}")
            records = read_metrics(paths.metrics)[0]
            if len(records) > seen:
                seen = len(records)
                first = first if first is not None else job.elapsed()
                last = job.elapsed()
            time.sleep(0.01)
    finally:
        if job.poll() is None:
            job.terminate()
    total = job.elapsed()
    if job.proc.returncode != 0:
        raise RuntimeError(f"the reference run exited {job.proc.returncode}:\n{job.output()[-4000:]}")
    first = total if first is None else first
    last = first if last is None else last
    profile = Profile(round(first, 3), round((last - first) / max(1, plan.steps - 1), 3), round(total - last, 3),
                      round(total, 3))
    return profile, Launch(index=0, resumable=None, outcome="exited", exit_code=0, seconds=round(total, 3))

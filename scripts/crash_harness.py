#!/usr/bin/env python
"""Crash harness: SIGKILL a 2-rank training job at random moments, restart it, check every time.

    .venv/bin/python scripts/crash_harness.py --trials 30 --seed 1 --aim mixed --out crash.json

What it does (docs/RELIABILITY.md, "Crashes", has the figures of the long campaign):

1. **Reference.** One uninterrupted job: ``torchrun --standalone --nproc_per_node 2 -m
   trainer.train --config configs/debug.toml`` for ``--steps`` steps, ``--training.seq_len 64``,
   a checkpoint every ``--interval`` steps (async ``double_buffer``, ``full_every`` 3 so deltas
   happen, one local replica directory, ``keep`` 3), every step's loss logged. Its timings (start-up,
   seconds per step, close) place the uniform kills.
2. **Crash runs.** The same job in a fresh folder, started, killed, restarted (it resumes from the
   newest committed step) until its planned steps are done; then the next run, until ``--trials``
   kills were made. Each kill freezes the whole job with SIGSTOP — the torchrun agent first (so it
   restarts nothing), then every descendant found under it in /proc (torchrun starts each worker
   in a session of its own, so neither the process group nor the session reaches them), rescanning
   until no new process appears — snapshots the two checkpoint folders and the metrics, then
   SIGKILLs every frozen process and waits until each is gone. The frozen snapshot is exactly the
   state the kill leaves, so the phase a kill struck in is observed, not guessed.
3. **When.** ``--aim uniform``: after a delay drawn uniformly over the launch's expected remaining
   time (start-up + remaining steps + close, from the reference), so kills land in start-up
   (lock, clean-up of the last kill's leftovers, resume, replica catch-up), training, saves and
   close in proportion to their duration; a launch that finishes first ends its run. ``--aim
   saves``: at one of five save moments, in rotation, of a step N drawn among the steps still to
   be saved: ``writing`` (its ``step-N.tmp-*`` directory appeared on the primary; kill 0-50 ms
   later), ``committed`` (``step-N`` appeared: the commit / retention / catalog / replication
   hand-off window; 0-30 ms later), ``replicating`` (its ``step-N.tmp-*`` appeared on the replica;
   0-30 ms later), ``retention`` and ``replica-retention`` (any ``step-*`` directory of that mount
   lost its manifest: retention is deleting it, manifest first; kill at once). The folders are
   polled every millisecond. ``--aim mixed`` alternates uniform and aimed kills, starting with a
   uniform one. The trainer runs with ``checkpoint.close_timeout`` 60 s (not 300), so that a
   replica copy that cannot finish delays an exit by at most a minute.
4. **After every kill** (:func:`check_after_kill`), with no process of the job left:
   - every listed step (``CheckpointRoot.steps()``) of the primary is a ``step-N`` directory
     holding ``manifest.json`` (no partial step, no ``.tmp-`` / ``.old-`` entry listed), its
     manifest parses and names step N;
   - every listed delta's chain (``manifest.base_step``, ``manifest.base``) walks down to a full
     checkpoint through listed, committed steps of the same mount;
   - every listed step loads: every tensor through ``ckpt.convert.full_tensors`` (every chunk
     verified, deltas replayed through the chain on that mount only) and every value decoded —
     the newest step (the one a restart resumes from) included;
   - the same on the replica, for its own listing; a step listed on both mounts has byte-identical
     manifests;
   - after the restart, the job resumed from exactly the newest step listed here (its log's
     ``resumed from checkpoint step N``; when it was killed again before saying so, not checked).
   Leftovers (``.tmp-``/``.old-`` entries, step directories without a manifest) and committed
   deltas that the listing hides (base gone) are recorded, not failures: the listing must not offer
   them and the next manager collects the primary's.
5. **At the end of each run** (:func:`compare_runs`): the job's last launch exited 0; every step's
   loss and learning rate in ``metrics.jsonl`` — every record, re-run steps included — equals the
   reference's bit for bit; the final checkpoint's tensors (model and optimizer, through
   ``full_tensors``) and values equal the reference's final checkpoint byte for byte, on the
   primary and on the replica; and no step the primary lists has a replica directory without a
   manifest (a killed replica deletion's leftover, which the replica's worker collects: see
   tests/reliability/test_crash.py's killed-deletion tests).

Prints one line per kill and per completed run, and a summary; ``--out`` writes it all as JSON
(kills, their aims, phases and delays, every check, failures, times). Exits 0 when every check
passed, 1 otherwise. Every wait is bounded (``--launch-timeout``); a job is never left behind
(killed on any exception, Ctrl-C or SIGTERM). The work folder is deleted afterwards unless
``--workdir`` names one or a check failed.

Scope: SIGKILL of every process at once (a crashed or preempted job); the kernel's page cache
survives, so this is not a power-loss test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckpt.format.names import TMP_MARK, is_leftover, step_name, step_of_entry  # noqa: E402
from tests.support.launch import descendants, job_env  # noqa: E402  (shared with the tests and benchmarks)

AIM_TARGETS = ("writing", "committed", "replicating", "retention", "replica-retention")
AIM_JITTER_S = {"writing": 0.05, "committed": 0.03, "replicating": 0.03, "retention": 0.0, "replica-retention": 0.0}
POLL_S = 0.001


@dataclass
class Plan:
    """The job every launch runs (the reference and the crash runs alike)."""

    steps: int = 12
    seq_len: int = 64
    interval: int = 1
    full_every: int = 3
    keep: int = 3
    nproc: int = 2
    close_timeout: float = 60.0  # the trainer's wait for pending replication at exit (default 300 s)
    launch_timeout: float = 300.0  # one launch, start to exit

    def trainer_args(self, dump_folder: Path, replica: Path) -> list[str]:
        return ["-m", "trainer.train", "--config", str(REPO / "configs" / "debug.toml"),
                "--job.dump_folder", str(dump_folder), "--training.steps", str(self.steps),
                "--training.seq_len", str(self.seq_len), "--metrics.log_freq", "1",
                "--checkpoint.enable", "true", "--checkpoint.interval", str(self.interval),
                "--checkpoint.async_mode", "double_buffer", "--checkpoint.full_every", str(self.full_every),
                "--checkpoint.keep", str(self.keep), "--checkpoint.replicas", str(replica),
                "--checkpoint.close_timeout", str(self.close_timeout)]


@dataclass
class RunPaths:
    """One run's folders: the trainer's dump folder (primary checkpoints under it) and its replica."""

    base: Path

    @property
    def dump(self) -> Path:
        return self.base / "run"

    @property
    def primary(self) -> Path:
        return self.dump / "checkpoints"

    @property
    def replica(self) -> Path:
        return self.base / "replica"

    @property
    def metrics(self) -> Path:
        return self.dump / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.base / "logs"


# -- processes -----------------------------------------------------------------------------------

def _state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (R, S, D, T, Z, ...), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


class Job:
    """One torchrun launch in a session of its own; :meth:`kill` takes down the agent and every
    worker. Live jobs are tracked so that :func:`kill_all` can end them on any way out."""

    live: set["Job"] = set()

    def __init__(self, plan: Plan, paths: RunPaths, log: Path):
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(plan.nproc),
             "--monitor-interval", "0.1", *plan.trainer_args(paths.dump, paths.replica)],
            cwd=REPO, env=job_env(), stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            start_new_session=True)
        Job.live.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None:
            self._done()
        return code

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def freeze(self, timeout: float = 2.0) -> tuple[list[int], bool]:
        """SIGSTOP the agent, then every descendant, rescanning until no new one appears; wait
        (bounded) until all are stopped. Returns the frozen pids and whether all were seen stopped."""
        frozen: list[int] = []
        while True:
            new = [pid for pid in [self.pid, *descendants(self.pid)] if pid not in frozen]
            if not new:
                break
            for pid in new:
                _signal(pid, signal.SIGSTOP)
                frozen.append(pid)
        deadline = time.monotonic() + timeout
        while True:
            states = [_state(pid) for pid in frozen]
            stopped = all(s in (None, "T", "t", "Z", "X") for s in states)
            if stopped or time.monotonic() > deadline:
                return frozen, stopped
            time.sleep(0.001)

    def kill(self, snapshot=None, timeout: float = 10.0) -> tuple[object, dict]:
        """Freeze the whole job, call ``snapshot()`` (the folders as the kill leaves them), SIGKILL
        every frozen process (and anything that appeared meanwhile) and wait until all are gone.
        Returns (the snapshot, facts about the kill)."""
        frozen, all_stopped = self.freeze()
        taken = None
        try:
            if snapshot is not None:
                taken = snapshot()
        finally:
            late = [pid for pid in descendants(self.pid) if pid not in frozen]
            for pid in [*frozen, *late]:
                _signal(pid, signal.SIGKILL)
            gone = self._reap([*frozen, *late], timeout)
        return taken, {"processes": len(frozen) + len(late), "all_stopped": all_stopped, "all_gone": gone}

    def _reap(self, pids: list[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout)
        while time.monotonic() < deadline:
            if all(_state(pid) in (None, "Z", "X") for pid in pids if pid != self.pid):
                self._done()
                return self.proc.poll() is not None
            time.sleep(0.005)
        self._done()
        return False

    def terminate(self) -> None:
        """End the job whatever it is doing (the harness is leaving)."""
        if self.proc.poll() is None:
            self.kill()
        self._done()

    def _done(self) -> None:
        Job.live.discard(self)
        if not self._log_file.closed:
            self._log_file.close()

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def kill_all() -> None:
    for job in list(Job.live):
        with contextlib.suppress(Exception):
            job.terminate()


# -- observing a job -----------------------------------------------------------------------------

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


def _unmanifested(folder: Path, names: list[str], known: set[str]) -> list[str]:
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
    parts = []
    if snapshot["primary_new_tmp"]:
        parts.append("save (primary write)")
    if snapshot["replica_new_tmp"]:
        parts.append("replica copy")
    if snapshot.get("primary_deleting"):
        parts.append("retention (primary delete)")
    if snapshot.get("replica_deleting"):
        parts.append("retention (replica delete)")
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


def drive(job: Job, paths: RunPaths, plan: Plan, launch: Launch, *, delay: float | None = None,
          aim: str | None = None, target_step: int | None = None, rng: random.Random | None = None) -> Launch:
    """Watch ``job`` until it exits or the kill condition holds, then kill it. ``delay``: kill that
    many seconds after the start; ``aim``/``target_step``: kill when the save moment ``aim`` of
    ``target_step`` is seen (plus a random jitter); neither: wait for the exit."""
    before = {"primary": set(listing(paths.primary)), "replica": set(listing(paths.replica))}
    for mount in ("primary", "replica"):  # step directories already without a manifest (dead deletions)
        before["unmanifested_" + mount] = set(_unmanifested(getattr(paths, mount), sorted(before[mount]), set()))
    metrics_lines = len(read_metrics(paths.metrics)[0])
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
        if aim is not None and fire_at is None:
            mount = "replica" if aim.startswith("replica") else "primary"
            names = [n for n in listing(getattr(paths, mount)) if n not in before[mount]]  # new entries only
            if aim.endswith("retention"):  # a step being deleted: its manifest is removed first
                folder = getattr(paths, mount)
                seen = bool(_unmanifested(folder, listing(folder), before["unmanifested_" + mount]))
            elif aim == "committed":
                seen = prefix in names
            else:  # writing, replicating: a new attempt of the step (not a dead one's leftover)
                seen = any(n.startswith(prefix + TMP_MARK) for n in names)
            if seen:
                jitter = (rng or random).uniform(0.0, AIM_JITTER_S[aim])
                fire_at = now + jitter
                launch.delay_s = now + jitter - job.started
        if fire_at is not None and now >= fire_at:
            def snapshot() -> dict:
                records = read_metrics(paths.metrics)[0]
                primary, replica = listing(paths.primary), listing(paths.replica)
                return {
                    "at_s": round(job.elapsed(), 3),
                    "primary": primary,
                    "replica": replica,
                    "primary_new_tmp": [n for n in primary if TMP_MARK in n and n not in before["primary"]],
                    "replica_new_tmp": [n for n in replica if TMP_MARK in n and n not in before["replica"]],
                    "primary_deleting": _unmanifested(paths.primary, primary, before["unmanifested_primary"]),
                    "replica_deleting": _unmanifested(paths.replica, replica, before["unmanifested_replica"]),
                    "logged_this_launch": len(records) - metrics_lines,
                    "last_logged": records[-1]["step"] if records else None,
                }

            launch.snapshot, launch.kill = job.kill(snapshot)
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


# -- checks --------------------------------------------------------------------------------------

def _tensor_bytes(tensor):
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8)


def load_step(path: Path):
    """Every tensor (verified, deltas replayed on this mount) and value of the checkpoint at ``path``:
    (manifest, {key: tensor}, {key: value})."""
    import ckpt
    from ckpt.convert import full_tensors
    from ckpt.read.source import ChunkSource
    from ckpt.storage import locate

    manifest = ckpt.read_manifest(path)
    tensors = dict(full_tensors(path, manifest=manifest))
    with ChunkSource(locate(path), manifest) as source:
        values = {key: source.value(key, entry) for key, entry in manifest.values.items()}
    return manifest, tensors, values


def check_mount(path: Path, *, verify: bool = True) -> dict:
    """The checks of one mount's listing (see the module docstring, item 4). Returns
    ``{"listed", "committed", "kinds", "verified", "problems", "leftovers", "hidden"}``; every
    entry of ``problems`` is a failed check."""
    import ckpt
    from ckpt.errors import CheckpointError
    from ckpt.root import CheckpointRoot

    report = {"listed": [], "committed": [], "kinds": {}, "verified": [], "problems": [], "leftovers": [],
              "hidden": []}
    names = listing(path)
    report["leftovers"] = [n for n in names if is_leftover(n)]
    if not path.exists():
        return report
    root = CheckpointRoot(path)
    listed, committed = root.steps(), root.committed()
    report["listed"], report["committed"] = listed, committed
    report["hidden"] = [s for s in committed if s not in listed]
    report["leftovers"] += [n for n in names if not is_leftover(n) and step_of_entry(n) is not None
                            and step_of_entry(n) not in committed]
    problems = report["problems"]
    manifests = {}
    for step in listed:
        directory = path / step_name(step)
        if step_name(step) not in names or not directory.is_dir():
            problems.append(f"{path}: step {step} listed, but there is no directory {step_name(step)}")
            continue
        if not (directory / "manifest.json").is_file():
            problems.append(f"{path}: step {step} listed without a manifest (a partial step)")
            continue
        try:
            manifests[step] = ckpt.read_manifest(directory)
        except CheckpointError as exc:
            problems.append(f"{path}: step {step} listed, its manifest does not read: {exc}")
            continue
        if manifests[step].step != step:
            problems.append(f"{path}: {step_name(step)}'s manifest names step {manifests[step].step}")
        report["kinds"][step] = manifests[step].kind
    for step, manifest in manifests.items():  # chains, down to a full checkpoint, on this mount
        seen, current, link = {step}, manifest, step
        while current.base_step is not None:
            base = current.base_step
            if current.base != step_name(base):
                problems.append(f"{path}: step {link} names base {current.base!r} for base_step {base}")
                break
            if base in seen:
                problems.append(f"{path}: step {step}'s chain loops at {base}")
                break
            if base not in listed or base not in manifests:
                problems.append(f"{path}: listed step {step} (a delta) lacks its base step {base}"
                                f" (chain {sorted(seen, reverse=True)})")
                break
            seen.add(base)
            current, link = manifests[base], base
        else:
            if current.kind != "full":
                problems.append(f"{path}: step {step}'s chain ends at step {link}, kind {current.kind!r}, no base")
    if verify:
        for step in sorted(manifests):
            try:
                load_step(path / step_name(step))
                report["verified"].append(step)
            except Exception as exc:  # any failure to load is a failed check
                problems.append(f"{path}: listed step {step} does not load: {type(exc).__name__}: {exc}")
    return report


def check_after_kill(paths: RunPaths) -> dict:
    """Every check after a kill (module docstring, item 4) on the primary and the replica."""
    from ckpt.read.committed import read_manifest_bytes
    from ckpt.storage import locate

    started = time.monotonic()
    primary, replica = check_mount(paths.primary), check_mount(paths.replica)
    problems = [*primary["problems"], *replica["problems"]]
    for step in sorted(set(primary["verified"]) & set(replica["verified"])):
        a = read_manifest_bytes(locate(paths.primary / step_name(step)))[1]
        b = read_manifest_bytes(locate(paths.replica / step_name(step)))[1]
        if a != b:
            problems.append(f"step {step}: the replica's manifest differs from the primary's")
    newest = primary["listed"][-1] if primary["listed"] else None
    if newest is not None and newest not in primary["verified"]:
        problems.append(f"the newest listed step {newest} (the one a restart resumes from) does not load")
    return {"ok": not problems, "problems": problems, "newest": newest, "primary": primary, "replica": replica,
            "seconds": round(time.monotonic() - started, 3)}


def _equal_values(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_tensor_bytes(a), _tensor_bytes(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal_values, a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def compare_checkpoints(path: Path, reference: Path) -> dict:
    """Tensors (dtype, shape, bytes) and values of two checkpoints, exactly."""
    import torch

    _, tensors, values = load_step(path)
    _, ref_tensors, ref_values = load_step(reference)
    problems = []
    if tensors.keys() != ref_tensors.keys():
        problems.append(f"{path}: tensor keys differ from the reference's "
                        f"(missing {sorted(ref_tensors.keys() - tensors.keys())[:3]}, "
                        f"extra {sorted(tensors.keys() - ref_tensors.keys())[:3]})")
    differing = [key for key in sorted(tensors.keys() & ref_tensors.keys())
                 if tensors[key].dtype != ref_tensors[key].dtype or tensors[key].shape != ref_tensors[key].shape
                 or not torch.equal(_tensor_bytes(tensors[key]), _tensor_bytes(ref_tensors[key]))]
    if differing:
        problems.append(f"{path}: {len(differing)} tensors differ from the reference's: {differing[:5]}")
    if values.keys() != ref_values.keys():
        problems.append(f"{path}: value keys differ from the reference's")
    differing = [key for key in sorted(values.keys() & ref_values.keys())
                 if not _equal_values(values[key], ref_values[key])]
    if differing:
        problems.append(f"{path}: {len(differing)} values differ from the reference's: {differing[:5]}")
    model = sum(1 for key in tensors if key.startswith("model."))
    return {"ok": not problems, "problems": problems, "tensors": len(tensors), "model_tensors": model,
            "optim_tensors": sum(1 for key in tensors if key.startswith("optim.")), "values": len(values),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def compare_runs(paths: RunPaths, reference: RunPaths, steps: int) -> dict:
    """The end-of-run checks (module docstring, item 5): losses and learning rates of every step,
    every record, bit for bit; the final checkpoint on both mounts byte for byte."""
    from ckpt.root import CheckpointRoot

    problems = []
    records, bad = read_metrics(paths.metrics)
    ref_records, _ = read_metrics(reference.metrics)
    ref = {r["step"]: r for r in ref_records}
    by_step: dict[int, list[dict]] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    missing = [s for s in range(1, steps + 1) if s not in by_step]
    if missing:
        problems.append(f"steps without a logged loss: {missing}")
    mismatched = []
    for step, logged in sorted(by_step.items()):
        for record in logged:
            expected = ref.get(step)
            if expected is None or not (float(record["loss"]).hex() == float(expected["loss"]).hex()
                                        and float(record["lr"]).hex() == float(expected["lr"]).hex()):
                mismatched.append((step, record["loss"], None if expected is None else expected["loss"]))
    if mismatched:
        problems.append(f"{len(mismatched)} logged losses/lrs differ from the uninterrupted run's "
                        f"(step, loss, reference): {mismatched[:5]}")
    final = {}
    for mount, ref_mount in ((paths.primary, reference.primary), (paths.replica, reference.replica)):
        name = "primary" if mount == paths.primary else "replica"
        if steps not in CheckpointRoot(mount).steps():
            problems.append(f"{name}: the final step {steps} is not listed ({CheckpointRoot(mount).steps()})")
            continue
        final[name] = compare_checkpoints(mount / step_name(steps), ref_mount / step_name(steps))
        problems += final[name]["problems"]
    leftovers = {name: [n for n in listing(mount) if is_leftover(n)]
                 + _unmanifested(mount, listing(mount), set())
                 for name, mount in (("primary", paths.primary), ("replica", paths.replica))}
    blocked = blocked_replica_steps(paths)
    if blocked:
        problems.append(f"replication blocked at the end of the run: on the replica, the directories of steps "
                        f"{blocked} have no manifest (a killed deletion's leftover) while the primary lists those "
                        f"steps; before 48523c3 every copy of them was refused ('already exists') and retried, newer "
                        f"steps waiting behind them, and each exit waited close_timeout")
    return {"ok": not problems, "problems": problems, "steps_logged": len(by_step),
            "records": len(records), "rerun_records": len(records) - len(by_step), "unparsable_lines": bad,
            "final": final, "leftovers_at_end": leftovers, "blocked_replica_steps": blocked}


def blocked_replica_steps(paths: RunPaths) -> list[int]:
    """Steps the primary lists whose replica directory exists without a manifest: ``copy_step``
    refuses such a target (``commit.begin(overwrite=False)``) and nothing on a replica removes it."""
    from ckpt.root import CheckpointRoot

    listed = set(CheckpointRoot(paths.primary).steps()) if paths.primary.exists() else set()
    return sorted(s for s in map(step_of_entry, _unmanifested(paths.replica, listing(paths.replica), set())) if s in listed)


# -- the campaign --------------------------------------------------------------------------------

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


def _aim_for(index: int, aim: str) -> str:
    """uniform, or a save target; ``mixed`` alternates, starting uniform."""
    if aim == "uniform" or (aim == "mixed" and index % 2 == 0):
        return "uniform"
    return "saves"


def _newest(path: Path) -> int | None:
    from ckpt.root import CheckpointRoot

    steps = CheckpointRoot(path).steps() if path.exists() else []
    return steps[-1] if steps else None


def campaign(workdir: Path, *, trials: int = 5, seed: int = 0, aim: str = "uniform", plan: Plan | None = None,
             prune: bool = False, log=print) -> dict:
    """Run the reference, then crash runs until ``trials`` kills were made and their runs finished.
    ``prune``: delete the checkpoints of each run that passed every check (its logs and metrics
    stay). Returns the summary (also what ``--out`` writes)."""
    plan = plan or Plan()
    rng = random.Random(seed)
    started = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    reference = RunPaths(workdir / "reference")
    summary: dict = {"plan": asdict(plan), "trials_planned": trials, "seed": seed, "aim": aim, "workdir": str(workdir),
                     "kills": [], "runs": [], "failures": []}
    profile, _ = run_reference(plan, reference)
    summary["reference"] = asdict(profile)
    log(f"reference: {plan.steps} steps uninterrupted in {profile.total_s:.1f} s (start-up {profile.startup_s:.1f} s, "
        f"{profile.step_s:.2f} s/step, close {profile.close_s:.1f} s)")
    kills, aimed, run_index = 0, 0, 0
    while kills < trials:
        run_index += 1
        paths = RunPaths(workdir / f"run-{run_index:03d}")
        launches: list[Launch] = []
        run_record = {"run": run_index, "launches": [], "kills": 0, "ok": False}
        previous_newest, failed = None, False
        while True:
            newest = _newest(paths.primary)
            launch = Launch(index=len(launches) + 1, resumable=newest)
            job = Job(plan, paths, paths.logs / f"launch-{launch.index:03d}.log")
            try:
                if kills < trials:
                    kind = _aim_for(kills, aim)
                    remaining = plan.steps - (newest or 0)
                    if kind == "uniform":
                        drive(job, paths, plan, launch, delay=rng.uniform(0.0, profile.expected(remaining)))
                    else:
                        target = AIM_TARGETS[aimed % len(AIM_TARGETS)]
                        saved = [s for s in range((newest or 0) + 1, plan.steps + 1)
                                 if s % plan.interval == 0 or s == plan.steps] or [plan.steps]
                        step = rng.choice(saved)
                        drive(job, paths, plan, launch, aim=target, target_step=step, rng=rng)
                else:
                    drive(job, paths, plan, launch)
            finally:
                if job.poll() is None:
                    job.terminate()
            launches.append(launch)
            resume_problem = None
            if launch.resumed_from is not None and launch.resumed_from != previous_newest:
                resume_problem = (f"launch {launch.index} resumed from step {launch.resumed_from}, but the newest "
                                  f"step listed after the last kill was {previous_newest}")
            elif launch.resumed_from is None and previous_newest is not None and launch.outcome == "exited":
                resume_problem = f"launch {launch.index} ran to the end without resuming from step {previous_newest}"
            if launch.outcome == "killed":
                kills += 1
                if launch.aim != "uniform":
                    aimed += 1
                checks = check_after_kill(paths)
                if resume_problem:
                    checks["problems"].append(resume_problem)
                    checks["ok"] = False
                phase = classify(launch.snapshot, plan.steps, launch.aim)
                record = {"trial": kills, "run": run_index, "launch": launch.index, "aim": launch.aim,
                          "target_step": launch.target_step, "delay_s": launch.delay_s, "phase": phase,
                          "snapshot": launch.snapshot, "kill": launch.kill, "resumed_from": launch.resumed_from,
                          "newest_after": checks["newest"],
                          "primary_listed": checks["primary"]["listed"], "replica_listed": checks["replica"]["listed"],
                          "verified": {"primary": checks["primary"]["verified"],
                                       "replica": checks["replica"]["verified"]},
                          "leftovers": {"primary": checks["primary"]["leftovers"],
                                        "replica": checks["replica"]["leftovers"]},
                          "hidden": {"primary": checks["primary"]["hidden"], "replica": checks["replica"]["hidden"]},
                          "blocked_replica_steps": blocked_replica_steps(paths),
                          "ok": checks["ok"] and launch.kill.get("all_gone", False),
                          "problems": checks["problems"] + ([] if launch.kill.get("all_gone") else
                                                            ["a process of the job survived the kill"]),
                          "check_s": checks["seconds"]}
                summary["kills"].append(record)
                run_record["kills"] += 1
                aim_text = (launch.aim if launch.aim == "uniform" or launch.aim.endswith("retention")
                            else f"{launch.aim} step {launch.target_step}")
                log(f"trial {kills}/{trials} run {run_index} launch {launch.index}: killed at {launch.delay_s:.2f} s "
                    f"({aim_text}) in {phase} [{launch.kill.get('processes')} processes; logged step "
                    f"{launch.snapshot.get('last_logged')}]; primary {checks['primary']['listed']} replica "
                    f"{checks['replica']['listed']}: "
                    + ("checks ok" if record["ok"] else "CHECKS FAILED: " + "; ".join(record["problems"]))
                    + f" ({checks['seconds']:.1f} s)")
                if not record["ok"]:
                    summary["failures"].append({"trial": kills, "run": run_index, "problems": record["problems"],
                                                "logs": str(paths.logs)})
                previous_newest = checks["newest"]
                continue
            if launch.outcome == "timeout" or launch.exit_code != 0:
                output = job.output()
                problem = (f"run {run_index} launch {launch.index} {launch.outcome}"
                           f" (exit {launch.exit_code}) after {launch.seconds:.1f} s; log {job.log}:\n{output[-3000:]}")
                summary["failures"].append({"run": run_index, "problems": [problem], "logs": str(paths.logs)})
                log(f"run {run_index}: FAILED: {problem}")
                failed = True
                break
            if resume_problem:
                summary["failures"].append({"run": run_index, "problems": [resume_problem], "logs": str(paths.logs)})
                failed = True
            break
        run_record["launches"] = [asdict(launch) for launch in launches]
        if not failed:
            result = compare_runs(paths, reference, plan.steps)
            run_record.update(result)
            final = result["final"]
            log(f"run {run_index}: done after {len(launches)} launches ({run_record['kills']} kills); "
                + (f"losses of {result['steps_logged']} steps bitwise equal to the uninterrupted run "
                   f"({result['rerun_records']} re-run steps' records too), final step {plan.steps} bitwise equal on "
                   f"{' and '.join(final)} ({final.get('primary', {}).get('tensors')} tensors, "
                   f"{final.get('primary', {}).get('values')} values)" if result["ok"] else
                   "FINAL COMPARISON FAILED: " + "; ".join(result["problems"])))
            if not result["ok"]:
                summary["failures"].append({"run": run_index, "problems": result["problems"], "logs": str(paths.logs)})
            elif prune and run_record["kills"] and all(k["ok"] for k in summary["kills"] if k["run"] == run_index):
                shutil.rmtree(paths.primary, ignore_errors=True)
                shutil.rmtree(paths.replica, ignore_errors=True)
        summary["runs"].append(run_record)
        if failed:
            break
    summary["seconds"] = round(time.monotonic() - started, 1)
    summary["totals"] = totals(summary)
    return summary


def totals(summary: dict) -> dict:
    kills = summary["kills"]
    by_phase: dict[str, int] = {}
    by_aim: dict[str, int] = {}
    for k in kills:
        by_phase[k["phase"]] = by_phase.get(k["phase"], 0) + 1
        by_aim[k["aim"]] = by_aim.get(k["aim"], 0) + 1
    runs = summary["runs"]
    return {
        "kills": len(kills),
        "kills_checked_ok": sum(k["ok"] for k in kills),
        "steps_verified_after_kills": sum(len(k["verified"]["primary"]) + len(k["verified"]["replica"]) for k in kills),
        "by_phase": dict(sorted(by_phase.items())),
        "by_aim": dict(sorted(by_aim.items())),
        "runs_completed": sum(1 for r in runs if "final" in r),
        "runs_bitwise_equal": sum(1 for r in runs if r.get("ok")),
        "launches": sum(len(r["launches"]) for r in runs) + 1,
        "rerun_step_records": sum(r.get("rerun_records", 0) for r in runs),
        "resumes_checked": sum(1 for r in runs for launch in r["launches"] if launch["resumed_from"] is not None),
        "kills_leaving_leftovers": sum(1 for k in kills if k["leftovers"]["primary"] or k["leftovers"]["replica"]),
        "kills_with_hidden_steps": sum(1 for k in kills if k["hidden"]["primary"] or k["hidden"]["replica"]),
        "kills_leaving_blocked_replica_steps": sum(1 for k in kills if k["blocked_replica_steps"]),
        "failures": len(summary["failures"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5, help="kills to make (default 5; 200 is the long campaign)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=12, help="planned steps of each run (default 12)")
    parser.add_argument("--aim", choices=("uniform", "saves", "mixed"), default="uniform",
                        help="uniform over the run, at saves, or alternating (default uniform)")
    parser.add_argument("--interval", type=int, default=1, help="checkpoint every N steps (default 1)")
    parser.add_argument("--launch-timeout", type=float, default=300.0, help="seconds one launch may take")
    parser.add_argument("--out", type=Path, help="write the JSON summary here")
    parser.add_argument("--workdir", type=Path, help="work here and keep it (default: a temporary folder, "
                                                     "kept only when a check failed)")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep the checkpoints of runs that passed (default: only their logs and metrics)")
    args = parser.parse_args(argv)
    if args.trials < 0 or args.steps < 1:
        parser.error("--trials must be >= 0 and --steps >= 1")

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="crash-harness-"))
    plan = Plan(steps=args.steps, interval=args.interval, launch_timeout=args.launch_timeout)
    summary = None
    try:
        summary = campaign(workdir, trials=args.trials, seed=args.seed, aim=args.aim, plan=plan,
                           prune=not args.keep_checkpoints)
    except KeyboardInterrupt:
        print("interrupted; every job killed", file=sys.stderr)
        return 130
    finally:
        kill_all()
    summary["command"] = " ".join([Path(sys.executable).name, "scripts/crash_harness.py", *(argv or sys.argv[1:])])
    t = summary["totals"]
    print(f"summary: {t['kills']} kills ({', '.join(f'{n} {a}' for a, n in t['by_aim'].items())}) in "
          f"{t['launches']} launches, {summary['seconds']:.0f} s; by phase: "
          + ", ".join(f"{p} {n}" for p, n in t["by_phase"].items())
          + f"; checks passed after {t['kills_checked_ok']}/{t['kills']} kills "
          f"({t['steps_verified_after_kills']} step copies verified); {t['runs_bitwise_equal']}/{t['runs_completed']} "
          f"runs bitwise equal to the uninterrupted run; failures: {t['failures']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if summary["failures"]:
        print(f"kept {workdir} (logs, checkpoints) for the failures above", file=sys.stderr)
    elif args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())

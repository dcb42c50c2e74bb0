#!/usr/bin/env python
#!/usr/bin/env python
"""Crash harness: SIGKILL a 2-rank training job at random moments, restart it, check every time.

    .venv/bin/python scripts/crash_harness.py --trials 30 --seed 1 --aim mixed --out crash.json

What it does (docs/RELIABILITY.md, "Crashes", has the figures of the long campaign):

1. **Reference.** One uninterrupted job: ``torchrun --standalone --nproc_per_node 2 -m
   trainer.train --config configs/debug.toml`` for ``--steps`` steps, ``--training.seq_len 64``,
   a checkpoint every ``--interval`` steps (async ``double_buffer``, ``full_every`` 3 so deltas
   happen, one local replica directory, ``keep`` 3), every step's loss logged. Its timings (start-up,
   seconds per step, close) place the uniform kills (scripts/crash_watch.py).
2. **Crash runs.** The same job in a fresh folder, started, killed, restarted (it resumes from the
   newest committed step) until its planned steps are done; then the next run, until ``--trials``
   kills were made. Each kill freezes the whole job with SIGSTOP — the torchrun agent first (so it
   restarts nothing), then every descendant found under it in /proc (torchrun starts each worker
   in a session of its own, so neither the process group nor the session reaches them), rescanning
   until no new process appears — snapshots the two checkpoint folders and the metrics, then
   SIGKILLs every frozen process and waits until each is gone. The frozen snapshot is exactly the
   state the kill leaves, so the phase a kill struck in is observed, not guessed
   (scripts/crash_job.py).
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
4. **After every kill** (:func:`~scripts.crash_checks.check_after_kill`), with no process of the
   job left: every step listed on the primary and on the replica is committed, its delta chain
   walks down to a full checkpoint on that mount, and every tensor and value loads (chunks verified);
   a step listed on both mounts has byte-identical manifests; the restart resumed from the newest
   step listed. Leftovers and committed deltas the listing hides are recorded, not failures.
5. **At the end of each run** (:func:`~scripts.crash_checks.compare_runs`): the job's last launch
   exited 0; every logged loss and learning rate, re-run steps included, equals the reference's bit
   for bit; the final checkpoint equals the reference's byte for byte on both mounts; no step the
   primary lists is blocked on the replica. scripts/crash_checks.py's docstring has each check.

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
import json
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ckpt.root import CheckpointRoot  # noqa: E402
from scripts.crash_checks import (blocked_replica_steps, check_after_kill, check_mount,  # noqa: E402
                                  compare_checkpoints, compare_runs)
from scripts.crash_job import Job, Plan, RunPaths, kill_all  # noqa: E402
from scripts.crash_watch import AIM_TARGETS, Launch, classify, drive, run_reference  # noqa: E402

# what tests/reliability/test_crash.py imports from here
__all__ = ["AIM_TARGETS", "Plan", "campaign", "check_mount", "compare_checkpoints", "kill_all", "main"]
MOUNTS = ("primary", "replica")


def _aim_for(index: int, aim: str) -> str:
    """uniform, or a save target; ``mixed`` alternates, starting uniform."""
    return "uniform" if aim == "uniform" or (aim == "mixed" and index % 2 == 0) else "saves"


def _newest(path: Path) -> int | None:
    steps = CheckpointRoot(path).steps() if path.exists() else []
    return steps[-1] if steps else None


def _resume_problem(launch: Launch, previous_newest: int | None) -> str | None:
    """What is wrong with where ``launch`` resumed, given the newest step listed after the last kill."""
    if launch.resumed_from is not None and launch.resumed_from != previous_newest:
        return (f"launch {launch.index} resumed from step {launch.resumed_from}, but the newest "
                f"step listed after the last kill was {previous_newest}")
    if launch.resumed_from is None and previous_newest is not None and launch.outcome == "exited":
        return f"launch {launch.index} ran to the end without resuming from step {previous_newest}"
    return None


class _Campaign:
    """What the runs of one campaign share: the plan, the random draws, the reference's timings, the
    kills made so far (uniform and aimed) and the summary every run adds to."""

    def __init__(self, workdir: Path, trials: int, seed: int, aim: str, plan: Plan, prune: bool, log):
        self.workdir, self.trials, self.aim, self.plan, self.prune, self.log = workdir, trials, aim, plan, prune, log
        self.rng = random.Random(seed)
        self.kills = self.aimed = 0
        self.reference = RunPaths(workdir / "reference")
        self.summary: dict = {"plan": asdict(plan), "trials_planned": trials, "seed": seed, "aim": aim,
                              "workdir": str(workdir), "kills": [], "runs": [], "failures": []}
        self.profile, _ = run_reference(plan, self.reference)
        self.summary["reference"] = asdict(self.profile)
        profile = self.profile
        log(f"reference: {plan.steps} steps uninterrupted in {profile.total_s:.1f} s (start-up "
            f"{profile.startup_s:.1f} s, {profile.step_s:.2f} s/step, close {profile.close_s:.1f} s)")

    def fail(self, run: int, problems: list[str], paths: RunPaths, **where) -> None:
        self.summary["failures"].append({**where, "run": run, "problems": problems, "logs": str(paths.logs)})

    def drive(self, job: Job, paths: RunPaths, launch: Launch, newest: int | None) -> None:
        """One launch: killed at the next kind of moment while kills remain, else run to its end."""
        plan = self.plan
        if self.kills >= self.trials:
            drive(job, paths, plan, launch)
        elif _aim_for(self.kills, self.aim) == "uniform":
            remaining = plan.steps - (newest or 0)
            drive(job, paths, plan, launch, delay=self.rng.uniform(0.0, self.profile.expected(remaining)))
        else:
            target = AIM_TARGETS[self.aimed % len(AIM_TARGETS)]
            saved = [s for s in range((newest or 0) + 1, plan.steps + 1)
                     if s % plan.interval == 0 or s == plan.steps] or [plan.steps]
            drive(job, paths, plan, launch, aim=target, target_step=self.rng.choice(saved), rng=self.rng)

    def killed(self, run: int, paths: RunPaths, launch: Launch, resume_problem: str | None) -> int | None:
        """Check the folders the kill left and record it; the newest step they list."""
        self.kills += 1
        if launch.aim != "uniform":
            self.aimed += 1
        checks = check_after_kill(paths)
        if resume_problem:
            checks["problems"].append(resume_problem)
            checks["ok"] = False
        phase = classify(launch.snapshot, self.plan.steps, launch.aim)
        both = lambda key: {mount: checks[mount][key] for mount in MOUNTS}  # noqa: E731
        gone = launch.kill.get("all_gone", False)
        record = {"trial": self.kills, "run": run, "launch": launch.index, "aim": launch.aim,
                  "target_step": launch.target_step, "delay_s": launch.delay_s, "phase": phase,
                  "snapshot": launch.snapshot, "kill": launch.kill, "resumed_from": launch.resumed_from,
                  "newest_after": checks["newest"],
                  **{f"{mount}_listed": checks[mount]["listed"] for mount in MOUNTS},
                  "verified": both("verified"), "leftovers": both("leftovers"), "hidden": both("hidden"),
                  "blocked_replica_steps": blocked_replica_steps(paths),
                  "ok": checks["ok"] and gone,
                  "problems": checks["problems"] + ([] if gone else ["a process of the job survived the kill"]),
                  "check_s": checks["seconds"]}
        self.summary["kills"].append(record)
        aim_text = (launch.aim if launch.aim == "uniform" or launch.aim.endswith("retention")
                    else f"{launch.aim} step {launch.target_step}")
        self.log(f"trial {self.kills}/{self.trials} run {run} launch {launch.index}: killed at {launch.delay_s:.2f} s "
                 f"({aim_text}) in {phase} [{launch.kill.get('processes')} processes; logged step "
                 f"{launch.snapshot.get('last_logged')}]; primary {checks['primary']['listed']} replica "
                 f"{checks['replica']['listed']}: "
                 + ("checks ok" if record["ok"] else "CHECKS FAILED: " + "; ".join(record["problems"]))
                 + f" ({checks['seconds']:.1f} s)")
        if not record["ok"]:
            self.fail(run, record["problems"], paths, trial=self.kills)
        return checks["newest"]

    def ended(self, run: int, paths: RunPaths, launch: Launch, job: Job, resume_problem: str | None) -> bool:
        """A launch that was not killed: whether it ended the run well."""
        if launch.outcome == "timeout" or launch.exit_code != 0:
            problem = (f"run {run} launch {launch.index} {launch.outcome}"
                       f" (exit {launch.exit_code}) after {launch.seconds:.1f} s; log {job.log}:\n{job.output()[-3000:]}")
            self.fail(run, [problem], paths)
            self.log(f"run {run}: FAILED: {problem}")
            return False
        if resume_problem:
            self.fail(run, [resume_problem], paths)
            return False
        return True

    def compare(self, run: int, paths: RunPaths, record: dict) -> None:
        """The end-of-run checks of a run that ended well; its checkpoints pruned when asked and clean."""
        result = compare_runs(paths, self.reference, self.plan.steps)
        record.update(result)
        final = result["final"]
        self.log(f"run {run}: done after {len(record['launches'])} launches ({record['kills']} kills); "
                 + (f"losses of {result['steps_logged']} steps bitwise equal to the uninterrupted run "
                    f"({result['rerun_records']} re-run steps' records too), final step {self.plan.steps} bitwise "
                    f"equal on {' and '.join(final)} ({final.get('primary', {}).get('tensors')} tensors, "
                    f"{final.get('primary', {}).get('values')} values)" if result["ok"] else
                    "FINAL COMPARISON FAILED: " + "; ".join(result["problems"])))
        if not result["ok"]:
            self.fail(run, result["problems"], paths)
        elif self.prune and record["kills"] and all(k["ok"] for k in self.summary["kills"] if k["run"] == run):
            shutil.rmtree(paths.primary, ignore_errors=True)
            shutil.rmtree(paths.replica, ignore_errors=True)

    def run(self, run: int) -> bool:
        """One crash run in a fresh folder: launched, killed, relaunched until its planned steps are
        done; whether it ended well."""
        paths = RunPaths(self.workdir / f"run-{run:03d}")
        launches: list[Launch] = []
        record = {"run": run, "launches": [], "kills": 0, "ok": False}
        previous_newest = None
        while True:
            newest = _newest(paths.primary)
            launch = Launch(index=len(launches) + 1, resumable=newest)
            job = Job(self.plan, paths, paths.logs / f"launch-{launch.index:03d}.log")
            try:
                self.drive(job, paths, launch, newest)
            finally:
                if job.poll() is None:
                    job.terminate()
            launches.append(launch)
            resume_problem = _resume_problem(launch, previous_newest)
            if launch.outcome != "killed":
                break
            previous_newest = self.killed(run, paths, launch, resume_problem)
            record["kills"] += 1
        ok = self.ended(run, paths, launch, job, resume_problem)
        record["launches"] = [asdict(launch) for launch in launches]
        if ok:
            self.compare(run, paths, record)
        self.summary["runs"].append(record)
        return ok


def campaign(workdir: Path, *, trials: int = 5, seed: int = 0, aim: str = "uniform", plan: Plan | None = None,
             prune: bool = False, log=print) -> dict:
    """Run the reference, then crash runs until ``trials`` kills were made and their runs finished.
    ``prune``: delete the checkpoints of each run that passed every check (its logs and metrics
    stay). Returns the summary (also what ``--out`` writes)."""
    started = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    runs = _Campaign(workdir, trials, seed, aim, plan or Plan(), prune, log)
    run = 0
    while runs.kills < trials:
        run += 1
        if not runs.run(run):
            break
    summary = runs.summary
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

"""The crash harness's job (scripts/crash_harness.py): what one launch runs and how it is killed.

:class:`Plan` is the torchrun command line every launch of the harness runs (the reference and the
crash runs alike) and :class:`RunPaths` one run's folders. :class:`Job` is one launch, in a session
of its own: :meth:`Job.kill` freezes the torchrun agent first (so it restarts nothing), then every
descendant found under it in /proc (torchrun starts each worker in a session of its own, so neither
the process group nor the session reaches them), rescanning until no new process appears; it takes
the caller's snapshot of the frozen state, then SIGKILLs every frozen process and waits until each
is gone. Every live job is tracked, so :func:`kill_all` leaves none behind on any way out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.launch import descendants, job_env  # shared with the tests and benchmarks

REPO = Path(__file__).resolve().parents[1]


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

    def mounts(self) -> dict[str, Path]:
        """``{"primary": ..., "replica": ...}``: the two checkpoint folders, by the name reports use."""
        return {"primary": self.primary, "replica": self.replica}


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

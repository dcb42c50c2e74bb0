"""Short trainer jobs, each process a real one that exits through the interpreter's own
finalization, without paying torch's import per process.

:class:`Launcher` starts ``python -m tests.support.exit_runs``, which imports torch and the trainer
once (:data:`PRELOAD`), then reads one job per stdin line (JSON: ``{"world": N, "argv": [...],
"out": folder}``, optionally ``"full_disk_steps": [...]``). For each job it forks the job's
processes and waits for them; each one runs ``trainer.train.main(argv)`` exactly as ``python -m
trainer.train`` would and raises ``SystemExit`` with its code out of this module's top level: it
then ends the way a command-line run or a torchrun worker ends (atexit handlers, interpreter
finalization, C++ static teardown), which is where a thread still holding a job's objects aborts
the process ("terminate called without an active exception", exit -6).

* ``world`` N >= 1: N ranks, each with the ``env://`` variables of its rank (a torchrun job's
  workers); 0: one process without them (``python -m trainer.train`` on its own).
* ``full_disk_steps``: every data file of those steps fails to write as on a full disk (ENOSPC).

Each process's stdout/stderr go to ``out/rank-<r>.out`` / ``.err``; the launcher answers each job
with one JSON line, the exit codes (a signal as a negative number, as torchrun reports it). Each
process's first exit handler also names, on stderr (:data:`LEFT_OVER`), the gloo threads still
running after ``main`` returned: the cause of that abort, seen whether or not this run's timing hit
it. One launcher serves any number of jobs (a test module's, through a module-scoped fixture).

Forking after ``import torch`` is what the tests' fork server does too (:mod:`tests.support.launch`):
the launcher starts no thread and no process group of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys

from tests.support.launch import job_env

LEFT_OVER = "process-group threads alive at exit"
"""How a process's stderr starts the line naming gloo threads still running when ``main`` returned
(the threads that can abort the interpreter's finalization)."""

# What the jobs' processes import, imported once before they are forked: torch._dynamo comes with
# a model's first initialisation (torch's decompositions) and with the pipeline's schedules, yaml
# with configs/debug.yaml; each would cost every forked process ~1 s of CPU again. Then the heap is
# frozen (tests.support.frozen_heap): each process's exit would visit all of it again otherwise.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.pipelining", "yaml", "ckpt.write.files", "trainer.train",
           "tests.support.frozen_heap")


class Launcher:
    """One launcher process; :meth:`run` runs a job in it and returns its processes' exit codes.
    A job that has not ended after ``timeout`` seconds kills the launcher and its processes."""

    def __init__(self, timeout: float = 600.0):
        from tests.support import REPO

        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.exit_runs"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO, env=job_env(),
                                     start_new_session=True)

    def run(self, job: dict) -> list[int]:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close(kill=True)
            raise AssertionError(f"the launcher gave no exit codes for {job['argv']} (it ended, or the job ran "
                                 f"past {self.timeout:.0f} s)")
        return json.loads(line)

    def close(self, kill: bool = False) -> None:
        if self.proc.stdin.closed:
            return
        if kill:
            with contextlib.suppress(ProcessLookupError):  # the launcher's session: its forked processes too
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.stdin.close()
        code = self.proc.wait(timeout=self.timeout)
        self.proc.stdout.close()
        assert kill or code == 0, f"the launcher exited {code}"

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)


def run_jobs(jobs: list[dict], timeout: float = 600.0) -> list[list[int]]:
    """Run ``jobs`` one after the other in one new launcher; each job's exit codes, in order."""
    with Launcher(timeout) as launcher:
        return [launcher.run(job) for job in jobs]


def _process(rank: int, job: dict, port: int) -> None:
    """In the forked process: its streams, its rendezvous, its faults, then the trainer's command
    line; SystemExit."""
    for fd, name in ((1, f"rank-{rank}.out"), (2, f"rank-{rank}.err")):
        target = os.open(os.path.join(job["out"], name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if world := job["world"]:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if steps := job.get("full_disk_steps"):
        _full_disk(steps)
    atexit.register(_report_group_threads)  # runs first of the exit handlers, right after main()
    from trainer.train import main

    raise SystemExit(main(job["argv"]))


def _full_disk(steps: list[int]) -> None:
    """Every data file of ``steps`` fails to write with ENOSPC."""
    import errno

    import ckpt.write.files

    real = ckpt.write.files.write_file

    def write_file(path, *args, **kwargs):
        if any(f"step-{s:08d}.tmp" in str(path) for s in steps):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *args, **kwargs)

    ckpt.write.files.write_file = write_file  # where write_rank looks it up


def group_threads() -> list[str]:
    """The names of this process's gloo threads (a process group's workers and transport loop)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(name for name in names if "gloo" in name)


def _report_group_threads() -> None:
    if threads := group_threads():
        print(f"{LEFT_OVER}: {threads}", file=sys.stderr, flush=True)


def _serve() -> None:
    from tests.support.launch import free_port

    for line in sys.stdin:
        job = json.loads(line)
        port, pids = free_port(), []
        for rank in range(max(1, job["world"])):
            sys.stdout.flush()  # nothing buffered may be written twice, by the process's finalization too
            pid = os.fork()
            if pid == 0:
                _process(rank, job, port)  # never returns
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    import importlib

    import torch

    for module in PRELOAD:  # imported once, before the processes are forked
        importlib.import_module(module)
    torch.set_num_threads(1)
    _serve()

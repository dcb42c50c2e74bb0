"""Many short trainer jobs, each rank a real process that exits through the interpreter's own
finalization, without paying torch's import per rank.

``python -m tests.support.exit_runs`` (run by :func:`run_jobs`) imports torch and the trainer once,
then reads one job per stdin line (JSON: ``{"world": N, "argv": [...], "out": folder}``). For each job
it forks N ranks and waits for them; a rank sets the ``env://`` variables of its job, runs
``trainer.train.main(argv)`` exactly as ``python -m trainer.train`` would, and raises ``SystemExit``
with its code out of this module's top level: the rank then ends the way a torchrun worker ends
(atexit handlers, interpreter finalization, C++ static teardown), which is where a thread still
holding a job's objects aborts the process ("terminate called without an active exception", exit
-6). Each rank's stdout/stderr go to ``out/rank-<r>.out`` / ``.err``; the launcher answers each job
with one JSON line, the ranks' exit codes (a signal as a negative number, as torchrun reports it).
The rank's first exit handler also names, on stderr (:data:`LEFT_OVER`), the gloo threads still
running after ``main`` returned: the cause of that abort, seen whether or not this run's timing hit it.

Forking after ``import torch`` is what the tests' fork server does too (:mod:`tests.support.launch`):
the launcher starts no thread and no process group of its own.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys

from tests.support.launch import job_env

LEFT_OVER = "process-group threads alive at exit"
"""How a rank's stderr starts the line naming gloo threads still running when ``main`` returned
(the threads that can abort the interpreter's finalization)."""


def run_jobs(jobs: list[dict], timeout: float = 600.0) -> list[list[int]]:
    """Run ``jobs`` (dicts of ``world``, ``argv``, ``out``) one after the other in one launcher
    process; the ranks' exit codes of each job, in order."""
    from tests.support import REPO

    lines = "".join(json.dumps(job) + "\n" for job in jobs)
    result = subprocess.run([sys.executable, "-m", "tests.support.exit_runs"], input=lines, capture_output=True,
                            text=True, cwd=REPO, env=job_env(), timeout=timeout)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def _rank(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    """In the forked rank: its streams, its rendezvous, then the trainer's command line; SystemExit."""
    for fd, name in ((1, f"rank-{rank}.out"), (2, f"rank-{rank}.err")):
        target = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    atexit.register(_report_group_threads)  # runs first of the exit handlers, right after main()
    from trainer.train import main

    raise SystemExit(main(argv))


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
        for rank in range(job["world"]):
            sys.stdout.flush()  # nothing buffered may be written twice, by the rank's finalization too
            pid = os.fork()
            if pid == 0:
                _rank(rank, job["world"], port, job["argv"], job["out"])  # never returns
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(json.dumps(codes), flush=True)


if __name__ == "__main__":
    import torch

    import trainer.train  # noqa: F401  (imported once, before the ranks are forked)

    torch.set_num_threads(1)
    _serve()

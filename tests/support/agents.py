"""Two torchrun agents on this machine as the two nodes of one job: start them, wait for a step
to be logged, kill one node or both, wait for them to end — every wait bounded.

    job = TwoNodes(logs, argv_of=lambda node: [...trainer arguments of that node...], max_restarts=1,
                   hold_after=7)  # every worker stops itself once, after step 7 (tests.support.held_trainer)
    job.start()
    with job.held():              # until every worker stopped: the files are what a kill now would leave
        shutil.copytree(...)      # (a copy for another scenario); SIGCONT at the block's end
    job.kill_worker(1)            # SIGKILL one worker of agent 1 (torchrun restarts the group)
    job.kill_node(1)              # SIGKILL agent 1 and its workers: the node is gone
    codes = job.wait()            # the agents' exit codes; at the deadline all is killed, the test fails

The agents meet through c10d rendezvous on 127.0.0.1 (``--local_addr 127.0.0.1``: loopback only);
c10d numbers them by itself, so which agent holds rank 0 may change between launches. Each agent
runs in its own session; its workers start sessions of their own (:func:`~tests.support.launch.descendants`
finds them). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch 2.13's default (the rendezvous's
TCP store shared with the workers) a restarted group reads the previous attempt's gloo addresses
and fails ("connectFullMesh failed ... Connection refused", pytorch/pytorch#135712); the static
rendezvous restarts each agent on its own and the group does not come back either.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from tests.support import REPO
from tests.support.launch import descendants, free_port, job_env

LAUNCH_S = 300.0  # a guard against hangs, far above a loaded 2-core box's time for one short job


class TwoNodes:
    """One job of two agents (``nproc`` workers each); see the module docstring."""

    def __init__(self, logs: Path, argv_of: Callable[[int], list[str]], *, nproc: int = 2, max_restarts: int = 0,
                 hold_after: int | None = None):
        self.logs = [logs / f"node{node}.log" for node in (0, 1)]
        self.argv_of, self.nproc, self.max_restarts = argv_of, nproc, max_restarts
        self.module = "trainer.train" if hold_after is None else "tests.support.held_trainer"
        self.hold = {} if hold_after is None else {"HOLD_AFTER_STEP": str(hold_after),
                                                   "HOLD_MARKS": str(_fresh_dir(logs / "hold-marks"))}
        self.procs: list[subprocess.Popen] = []
        self.deadline = 0.0

    def start(self) -> "TwoNodes":
        endpoint, run_id = f"127.0.0.1:{free_port()}", f"nodes-{uuid.uuid4().hex[:12]}"
        env = job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **self.hold)
        self.deadline = time.monotonic() + LAUNCH_S
        for node, log in enumerate(self.logs):
            launch = ["--nnodes", "2", "--nproc_per_node", str(self.nproc), "--rdzv_backend", "c10d",
                      "--rdzv_endpoint", endpoint, "--rdzv_id", run_id, "--local_addr", "127.0.0.1",
                      "--max_restarts", str(self.max_restarts), "-m", self.module, *self.argv_of(node)]
            with log.open("ab") as out:  # appended: a second launch's log follows the first's
                self.procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launch],
                                                   cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True))
        return self

    def outputs(self) -> list[str]:
        return [log.read_text(errors="replace") if log.exists() else "" for log in self.logs]

    def kill_worker(self, node: int) -> int:
        """SIGKILL one trainer worker of agent ``node``; its pid."""
        workers = self._workers([self.procs[node]])
        assert workers, f"agent {node} has no worker running"
        os.kill(workers[0], signal.SIGKILL)
        return workers[0]

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Inside the block every worker of both agents has stopped itself after ``hold_after``
        (waited for until /proc says so: 2 × ``nproc`` trainer processes stopped); continued
        (SIGCONT) after it. The agents themselves run on."""
        assert self.hold, "TwoNodes(hold_after=...) holds its workers"
        workers: list[int] = []
        try:
            while len(workers := self._workers(self.procs)) < 2 * self.nproc or not all(map(_stopped, workers)):
                if time.monotonic() > self.deadline or any(p.poll() is not None for p in self.procs):
                    self._fail(f"the workers never all stopped after step {self.hold['HOLD_AFTER_STEP']}")
                time.sleep(0.05)
            yield
        finally:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)

    def _workers(self, procs: list[subprocess.Popen]) -> list[int]:
        module = self.module.encode()
        return [pid for p in procs for pid in descendants(p.pid) if _runs(pid, module)]

    def kill_node(self, node: int) -> None:
        """SIGKILL agent ``node`` and every process under it, and wait for the agent's end."""
        self._kill([self.procs[node]])

    def kill_all(self) -> None:
        self._kill(self.procs)

    def wait(self, *, fail_on_error: bool = True) -> list[int]:
        """The agents' exit codes once both ended; past the deadline (or, with ``fail_on_error``,
        once one failed) everything is killed and the test fails with both logs."""
        while None in (codes := [p.poll() for p in self.procs]):
            failed = fail_on_error and any(code not in (None, 0) for code in codes)
            if failed or time.monotonic() > self.deadline:
                self._fail("an agent failed" if failed else f"still running after {LAUNCH_S:.0f} s")
            time.sleep(0.1)
        if fail_on_error and codes != [0, 0]:
            self._fail("an agent failed")
        return codes

    def _kill(self, procs: list[subprocess.Popen]) -> None:
        workers = [pid for p in procs for pid in descendants(p.pid)]  # before their agents go
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
                os.killpg(p.pid, signal.SIGKILL)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)

    def _fail(self, why: str) -> None:
        self.kill_all()
        codes = [p.returncode for p in self.procs]
        report = "\n".join(f"--- agent {i} (exit {code}), {log}:\n{out[-5000:]}"
                           for i, (code, log, out) in enumerate(zip(codes, self.logs, self.outputs())))
        raise AssertionError(f"{why}; agents exited {codes}\n{report}")


def _fresh_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=False)
    return path


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone: a worker that died is not a held one
        return False
    return stat[stat.rindex(")") + 2] in "Tt"


def _runs(pid: int, module: bytes) -> bool:
    """Whether ``pid`` is a worker running ``module`` (``-m module`` on its command line)."""
    try:
        return module in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone meanwhile
        return False

"""The jobs of ``bench_recover.py``: one job of two "nodes" on this machine, and the nodes' memory
folders under ``/dev/shm``.

* :func:`two_nodes`: one job of 2 × ``per_node`` ranks (default 2), as on two machines: two torchrun
  agents (``--nnodes 2 --node_rank n --nproc_per_node per_node``, static rendezvous on loopback), so
  each rank sees ``LOCAL_WORLD_SIZE=per_node`` and ranks are numbered node by node (with 2: ranks 0-1
  node 0, ranks 2-3 node 1), as the memory tier counts them.
  Each node's command line is its own (its memory folder). Returns the launcher's clock
  (``time.time()``) taken right before the agents start; a failed job raises
  :class:`resume_jobs.JobFailed` with both logs' error lines and tails (unless ``may_fail``: a crash
  job is meant to die).
* :class:`NodeMemory`: the two nodes' RAM file systems, ``/dev/shm/ckpt-bench-recover-<pid>-<token>/node<n>``
  (the folder is 0700 and removed on leaving the ``with`` block, whatever happened: nothing of a run
  stays in ``/dev/shm``). :meth:`NodeMemory.keep` copies what a run left there to disk,
  :meth:`NodeMemory.restore` puts it back before each recovery (a recovery's clean finish removes
  the run's memory steps), optionally with one node's folder empty: the node was replaced.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO  # first: puts this checkout's root on sys.path

from resume_jobs import JobFailed  # noqa: E402
from tests.support.launch import HOST, descendants, free_port, job_env  # noqa: E402

NODES = 2
SHM = Path("/dev/shm")
TAIL = 15


def two_nodes(script: Path, node_args, log: Path, timeout: float, env: dict | None = None,
              may_fail: bool = False, per_node: int = 2) -> float:
    """Run ``script`` as one job on two nodes of ``per_node`` ranks (``node_args(n)``: node n's
    arguments); returns the launcher's clock taken right before the start. Logs: ``log`` with
    ``.node<n>`` added."""
    port = free_port()
    logs = [log.with_name(f"{log.name}.node{n}") for n in range(NODES)]
    procs, files = [], []
    launched = time.time()
    try:
        for n in range(NODES):
            files.append(open(logs[n], "w"))
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--node_rank={n}",
                   f"--nproc_per_node={per_node}", f"--master_addr={HOST}", f"--master_port={port}",
                   str(script), *node_args(n)]
            procs.append(subprocess.Popen(cmd, stdout=files[-1], stderr=subprocess.STDOUT, cwd=REPO,
                                          env=job_env(**(env or {}))))
        deadline = time.monotonic() + timeout
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:  # a job past its time: its workers (sessions of their own) first, then the agent
            if p.poll() is None:
                for pid in descendants(p.pid):
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                p.kill()
                p.wait()
        for f in files:
            f.close()
    if any(codes) and not may_fail:
        raise JobFailed(f"job failed (exit {codes}): {script.name} {' '.join(node_args(0))}\n" + "\n".join(
            _tail(path) for path in logs))
    return launched


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()
    causes = [line for line in lines if any(k in line for k in ("Error", "error:", "terminate called", "what():"))]
    return f"--- {log.name}\n" + "\n".join([*causes[:TAIL], "...", *lines[-TAIL:]])


class NodeMemory:
    """The two nodes' memory folders on this machine's ``/dev/shm`` (see the module docstring)."""

    def __init__(self, kept: Path):
        self.path = SHM / f"ckpt-bench-recover-{os.getpid()}-{secrets.token_hex(4)}"
        self.kept = kept  # a copy on disk of what the saving run left in memory

    def __enter__(self) -> "NodeMemory":
        self.path.mkdir(mode=0o700)
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def node(self, n: int) -> Path:
        return self.path / f"node{n}"

    def held_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def clear(self) -> None:
        for n in range(NODES):
            shutil.rmtree(self.node(n), ignore_errors=True)

    def keep(self) -> None:
        """Copy both nodes' folders (modes kept) to disk, as the saving run left them."""
        shutil.rmtree(self.kept, ignore_errors=True)
        shutil.copytree(self.path, self.kept, symlinks=True)

    def restore(self, lost: int | None = None) -> None:
        """Both nodes' folders back as the saving run left them; node ``lost``'s empty (a new machine)."""
        self.clear()
        for n in range(NODES):
            if n == lost:
                self.node(n).mkdir(mode=0o700)
            else:
                shutil.copytree(self.kept / f"node{n}", self.node(n), symlinks=True)

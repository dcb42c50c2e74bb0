"""The jobs of ``bench_resume.py``: torchrun jobs of ``resume_rank.py`` started and waited for, the
checkpoint evicted from the page cache before one, and the ranks' stamps turned into the parts of a
resume.

* :func:`torchrun`: one ``python -m torch.distributed.run --standalone`` job (the environment of
  ``job_env``: gloo on loopback, one intra-op thread); returns the launcher's clock taken right before
  the launch, raises :class:`JobFailed` with the log's error lines and tail.
* :func:`rank_records`: what each rank wrote (``<out>/rank-<R>.json``: its stamps and its result).
* :func:`parts_of`: the parts of one resume (:data:`PARTS`): each boundary is the latest rank's
  stamp, each part the gap to the boundary before, ``total`` from the launcher's clock.
* :func:`titan_available`: whether torchtitan's checkpoint manager can be imported (the dev extra).
* :func:`evict`: ``fsync`` + ``posix_fadvise(DONTNEED)`` of every file under a path, so the next read
  comes from storage; :func:`dir_bytes`: a checkpoint's bytes on disk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO  # first: puts this checkout's root on sys.path

from tests.support.launch import job_env  # noqa: E402

RANK_SCRIPT = Path(__file__).resolve().parent / "resume_rank.py"
# (the stamp resume_rank.py takes, the part of the resume that ends there), in order
PARTS = (("started", "launcher + interpreter"), ("imported", "imports"), ("built", "process group + build"),
         ("loaded", "checkpoint load"), ("stepped", "first step"))
TAIL = 20  # lines of a failed job's log in its error


def torchrun(nproc: int, rank_args: list[str], log: Path, timeout: float) -> float:
    """Start one torchrun job of ``resume_rank.py`` and wait for it; returns the launcher's clock
    (``time.time()``) taken right before the launch. A failed job raises with its log's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(RANK_SCRIPT), *rank_args]
    with open(log, "w") as f:
        launched = time.time()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=job_env(), timeout=timeout)
    if proc.returncode != 0:
        lines = log.read_text(errors="replace").splitlines()
        causes = [line for line in lines if any(k in line for k in ("Error", "error:", "terminate called", "what():"))]
        raise JobFailed(f"job failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                        + "\n".join([*causes[:TAIL], "...", *lines[-TAIL:]]))
    return launched


class JobFailed(RuntimeError):
    """A torchrun job of the benchmark exited non-zero (its log's error lines and tail in the message)."""


def titan_available() -> bool:
    try:
        return importlib.util.find_spec("torchtitan.components.checkpointer") is not None
    except ModuleNotFoundError:
        return False


def rank_records(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nproc)]


def evict(path: Path) -> None:
    """Flush and evict every file under ``path`` from the page cache (the next read comes from storage)."""
    os.sync()
    for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def parts_of(launched: float, ranks: list[dict]) -> dict[str, float]:
    """The parts of one resume (seconds): each boundary is the latest rank's stamp, each part the gap
    to the boundary before; ``total`` is the last boundary minus the launcher's clock."""
    parts, previous = {}, launched
    for stamp, part in PARTS:
        boundary = max(r["stamps"][stamp] for r in ranks)
        parts[part] = boundary - previous
        previous = boundary
    parts["total"] = previous - launched
    return parts


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

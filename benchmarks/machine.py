"""The machine a benchmark ran on, and its other load: part of every benchmark's report.

``cpu_model``, ``memory_description``, ``filesystem_of``, ``machine_description`` (CPU, memory,
filesystem of the work dir, kernel, Python/torch and other versions), ``git_state`` (the code
measured), ``pressure_totals`` (PSI), ``top_other_processes`` and ``Load`` (the machine's other load
over a stretch of the run: load average, PSI stall percentages, other busy processes). Imported
through :mod:`harness`, which re-exports every name.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Sequence

import torch

from probes import meminfo

REPO = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_description() -> str:
    fields = meminfo()
    if not fields:
        return "unknown"
    return f"{fields.get('MemTotal', 0) / 2**30:.1f} GiB total, {fields.get('MemAvailable', 0) / 2**30:.1f} GiB available"


def filesystem_of(path: Path) -> str:
    """'<fstype> on <mountpoint> (<device>, <options>)' for the mount holding ``path``."""
    path = path.resolve()
    best = None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts, *_ = line.split()
                mnt = mnt.replace("\\040", " ")
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and (
                    best is None or len(mnt) > len(best[1])
                ):
                    best = (dev, mnt, fstype, opts)
    except OSError:
        pass
    if best is None:
        return "unknown"
    dev, mnt, fstype, opts = best
    return f"{fstype} on {mnt} ({dev}, {opts})"


def machine_description(work: Path | None = None, versions: Sequence[str] = (), cpu_extra: str = "") -> list[str]:
    """The report's machine lines: CPU (+ ``cpu_extra``), memory, the filesystem of ``work`` (if
    given), kernel, Python, torch and ``versions`` (e.g. ``"numpy 2.1"``, ``"torch threads 2"``)."""
    lines = [
        f"CPU: {cpu_model()}, nproc={os.cpu_count()} (affinity {len(os.sched_getaffinity(0))}){cpu_extra}",
        f"Memory: {memory_description()}",
    ]
    if work is not None:
        lines.append(f"Work dir filesystem: {filesystem_of(work)}")
    lines.append(f"Kernel: {platform.system()} {platform.release()}; Python {platform.python_version()}; "
                 + "; ".join([f"torch {torch.__version__}", *versions]))
    return lines


def git_state() -> str:
    """HEAD's short hash, plus the files of ``ckpt``/``trainer`` with uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "ckpt", "trainer"],
                               cwd=REPO, capture_output=True, text=True, timeout=5).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else "")


def pressure_totals() -> dict[str, int]:
    """Cumulative 'some' stall microseconds from /proc/pressure (PSI), where the kernel has it."""
    totals = {}
    for resource in ("cpu", "io", "memory"):
        try:
            with open(f"/proc/pressure/{resource}") as f:
                for line in f:
                    if line.startswith("some"):
                        totals[resource] = int(line.split("total=")[1])
        except (OSError, IndexError, ValueError):
            pass
    return totals


def top_other_processes(limit: int = 3) -> list[str]:
    """The busiest other processes right now (by %CPU over their lifetime, from ps)."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True,
                             timeout=5).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError):
        return []
    rows = []
    for line in out:
        pid, pcpu, cmd = line.strip().split(None, 2)
        if int(pid) == os.getpid() or float(pcpu) < 5:
            continue
        rows.append(f"{cmd[:70]} ({pcpu}% CPU)")
        if len(rows) == limit:
            break
    return rows


class Load:
    """The machine's other load from construction to ``stop()``: the 1-minute load average at both
    ends, the share of the time some task stalled (PSI, per resource) and, with ``processes``, the
    busiest other processes at both ends. On a shared box this dominates the spread."""

    def __init__(self, processes: bool = False):
        self.processes = processes
        self.others_start = top_other_processes() if processes else []
        self.load_start, self.psi_start, self.t0 = os.getloadavg()[0], pressure_totals(), time.monotonic()
        self.elapsed = 0.0
        self.load_end, self.psi, self.others_end = self.load_start, "", []

    def stop(self) -> Load:
        self.elapsed = time.monotonic() - self.t0
        psi_end = pressure_totals()
        self.psi = ", ".join(f"{k} {100 * (psi_end[k] - v) / 1e6 / self.elapsed:.0f}%"
                             for k, v in self.psi_start.items() if k in psi_end)
        self.load_end = os.getloadavg()[0]
        if self.processes:
            self.others_end = top_other_processes()
        return self

    def describe(self, during: str = "", note: str = "") -> str:
        """'load average A at start, B at end<note>; time some task stalled (PSI) <during>: cpu x%, ...'"""
        text = f"load average {self.load_start:.1f} at start, {self.load_end:.1f} at end{note}"
        if self.psi:
            text += f"; time some task stalled (PSI){' ' + during if during else ''}: {self.psi}"
        if self.processes:
            text += (f"; other busy processes at start: {'; '.join(self.others_start) or 'none'}, at end: "
                     + ("; ".join(self.others_end) or "none"))
        return text

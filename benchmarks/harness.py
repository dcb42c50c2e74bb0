"""Scaffolding shared by the benchmark scripts (``bench_*.py``): set-up, the machine, timing, clean-up.

No benchmark lives here, and every script imports what it needs from this module and its siblings —
``peers`` (the systems compared), ``states`` (the states saved), ``probes`` (memory from /proc),
``report`` (the section and the JSON record) — never from another script. This module provides:

- Import set-up: puts the repository root first on ``sys.path`` (``REPO``), so that
  ``python benchmarks/bench_x.py`` measures the ``ckpt``/``trainer`` of the checkout it is run from
  rather than whichever checkout is pip-installed (editable). Import it before ``ckpt``/``trainer``.
- Command line: ``argument_parser`` (the script's docstring as description, plus the ``--dir``,
  ``--out``, ``--json`` and optionally ``--keep`` options every script has), ``add_modes`` /
  ``apply_mode`` (``--tiny``, ``--quick`` and the full run as presets of the options: a preset
  fills what the command line left unset), ``package_version``.
- Machine description: ``cpu_model``, ``memory_description``, ``filesystem_of``, ``machine_description``
  (CPU, memory, filesystem of the work dir, kernel, Python/torch and other versions),
  ``git_state`` (the code measured), ``pressure_totals`` (PSI), ``top_other_processes`` and
  ``Load`` (the machine's other load over a stretch of the run: load average, PSI stall
  percentages, other busy processes).
- Timing: ``timed`` (one call, after ``gc.collect``), ``rotated`` (the order of the methods in a
  repeat, rotated so that slow drifts of the machine hit all alike), ``median``, ``paired`` (the
  per-repeat ratios of two methods timed in the same repeats).
- Checks: ``check_equal`` (a loaded state bitwise equal to the saved one).
- Clean-up: ``drop_caches`` (``sync`` and, when permitted, dropping the page cache), ``fsync_path``,
  ``remove``, ``settle`` (``gc.collect`` + glibc ``malloc_trim``), ``work_dir`` (a temporary work
  dir under ``benchmarks/_work/`` or ``--dir``, removed afterwards with its parent when empty).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from probes import meminfo  # noqa: E402

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def argument_parser(doc: str, keep: bool = False) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc`` (the script's docstring, shown whole by
    ``--help``) with the options every benchmark has: ``--dir``, ``--out`` (and ``--keep``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="parent of the work dir (default benchmarks/_work)")
    parser.add_argument("--out", help="Markdown file in which to add/replace the results section")
    parser.add_argument("--json", help="write the section and its numbers as JSON here (for run.py)")
    if keep:
        parser.add_argument("--keep", action="store_true", help="keep the work dir (debugging)")
    return parser


def preset_text(preset: dict) -> str:
    """A preset as the options it stands for: ``--gib 0.25 --repeats 1``."""
    def shown(value) -> str:
        return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)

    return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {shown(v)}")
                    for k, v in preset.items() if v is not False)


def add_modes(parser: argparse.ArgumentParser, tiny: dict, quick: dict, quick_note: str = "",
              tiny_note: str = "") -> None:
    """``--quick`` and ``--tiny`` (the tests' smoke run through every part), each described by the
    options of its preset."""
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run{quick_note}: {preset_text(quick)} unless given")
    parser.add_argument("--tiny", action="store_true",
                        help=f"the tests' smoke run{tiny_note}: {preset_text(tiny)} unless given")


def apply_mode(args: argparse.Namespace, tiny: dict, quick: dict, full: dict) -> None:
    """Fill every option the command line left unset (None) from the preset of the mode: ``tiny``
    with ``--tiny``, else ``quick`` with ``--quick``, else ``full``; an option given always wins."""
    for key, value in (tiny if args.tiny else quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def package_version(package: str) -> str:
    """The installed version of ``package``, or 'not installed' (an optional peer)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------------------------
# Machine description
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def timed(fn: Callable[[], None]) -> float:
    """Wall seconds (``time.perf_counter``) of ``fn()``, after a ``gc.collect()`` outside the timing."""
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """``items`` in the order of repeat ``rep``: rotated by one per repeat."""
    shift = rep % len(items)
    return [*items[shift:], *items[:shift]]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per repeat, ``numerators[i] / denominators[i]``: two methods timed in the same repeat (a
    peer's seconds over ours is ours' speed in multiples of the peer's)."""
    return [a / b for a, b in zip(numerators, denominators)]


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
def check_equal(live: dict, reference: dict, what: str) -> None:
    """Raise unless every tensor of the flat state ``reference`` equals ``live``'s bitwise."""
    for key, t in reference.items():
        if not torch.equal(live[key], t):
            raise RuntimeError(f"{what}: {key} differs after load")


# ---------------------------------------------------------------------------------------------
# Clean-up
# ---------------------------------------------------------------------------------------------
def drop_caches(enabled: bool) -> bool:
    """sync, then drop the page cache if allowed. Returns whether the cache was dropped."""
    os.sync()
    if not enabled:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:
    _LIBC = None


def settle() -> None:
    """Collect garbage and let glibc hand free heap pages back (``malloc_trim``), so that RSS shows
    live memory rather than what an earlier phase freed but the allocator still holds."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@contextlib.contextmanager
def work_dir(parent: str | None, prefix: str, keep: bool = False) -> Iterator[Path]:
    """A fresh temporary directory under ``parent`` (default ``benchmarks/_work/``, gitignored);
    afterwards (unless ``keep``) it is removed, and ``parent`` too if nothing else is left in it."""
    base = Path(parent) if parent else REPO / "benchmarks" / "_work"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
            try:
                base.rmdir()  # only if empty (ours was the only thing in it)
            except OSError:
                pass

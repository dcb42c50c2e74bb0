"""Scaffolding shared by the benchmark scripts (``bench_*.py``); no benchmark lives here.

Every script imports what it needs from this module and nothing from another script. It provides:

- Import set-up: puts the repository root first on ``sys.path`` (``REPO``), so that
  ``python benchmarks/bench_x.py`` measures the ``ckpt``/``trainer`` of the checkout it is run from
  rather than whichever checkout is pip-installed (editable). Import it before ``ckpt``/``trainer``.
- Command line: ``argument_parser`` (the script's docstring as description, plus the ``--dir``,
  ``--out`` and optionally ``--keep`` options every script has).
- Machine description: ``cpu_model``, ``meminfo``, ``filesystem_of``, ``machine_description``
  (CPU, memory, filesystem of the work dir, kernel, Python/torch and other versions),
  ``git_state`` (the code measured), ``pressure_totals`` (PSI), ``top_other_processes`` and
  ``Load`` (the machine's other load over a stretch of the run: load average, PSI stall
  percentages, other busy processes).
- Timing: ``timed`` (one call, after ``gc.collect``), ``rotated`` (the order of the methods in a
  repeat, rotated so that slow drifts of the machine hit all alike), ``median`` and ``median_span``
  (median with min-max, as the tables print it).
- Clean-up: ``drop_caches`` (``sync`` and, when permitted, dropping the page cache), ``fsync_path``,
  ``remove``, ``settle`` (``gc.collect`` + glibc ``malloc_trim``), ``work_dir`` (a temporary work
  dir under ``benchmarks/_work/`` or ``--dir``, removed afterwards with its parent when empty).
- Reports: ``verdict`` (goal met/missed), ``command_line`` (the command that reproduces the run),
  ``provenance`` (the closing lines of every results section: machine, run conditions, date,
  command), ``publish`` and ``write_section`` (print the section; add or replace it in the results
  file).
- Structured results for ``run.py``: ``Metric``, ``Goal`` and ``write_json`` (``--json PATH``: the
  section's markdown plus its numbers — medians with min-max per system, the goals it checks, and
  series for the plots — in one JSON file; the runner builds RESULTS.md's summary and plots from it).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import os
import platform
import shlex
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


def meminfo() -> str:
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
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
        f"Memory: {meminfo()}",
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


def median_span(xs: Sequence[float], digits: int = 3) -> str:
    """'median (min–max)', as the tables print a set of repeats."""
    return f"{median(xs):.{digits}f} ({min(xs):.{digits}f}–{max(xs):.{digits}f})"


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


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------
def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**missed**")


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that reproduces this run, as it goes into the report (``--json FILE``, where the
    runner keeps the numbers, is an output and left out)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--json" in args:
        at = args.index("--json")
        del args[at:at + 2]
    args = [a for a in args if not a.startswith("--json=")]
    return "python " + shlex.join([os.path.relpath(sys.argv[0], REPO) if argv is None else f"benchmarks/{script}",
                                   *args])


def provenance(machine: list[str], command: str, load: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The closing lines of every results section: the machine, the other load on it during the run
    (``Load.describe()``), ``extra`` lines, the date, then the command."""
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [*machine, *([f"Other load on the machine: {load}"] if load is not None else []), *extra, f"Date: {date}"]
    return ["Machine:", *[f"- {line}" for line in lines], "", "Command:", "", "```", command, "```", ""]


def publish(section: str, out: str | None) -> None:
    """Print the section and, with ``--out``, add or replace it in the results file."""
    print()
    print(section)
    if out:
        write_section(Path(out), section)
        print(f"wrote section to {out}")


def write_section(out: Path, section: str) -> None:
    """Add or replace ``section`` (its first line is its ``## `` heading) in the results file,
    re-read right before writing so other benchmarks' sections are kept."""
    heading = section.split("\n", 1)[0]
    text = out.read_text() if out.exists() else "# Benchmark results\n\n"
    start = text.find(heading)
    if start < 0:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(heading))
        tail = text[end + 1 :] if end >= 0 else ""
        new = text[:start] + section + ("\n" + tail if tail else "")
    out.write_text(new.rstrip("\n") + "\n")


def model_and_optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint of (model, optimizer) holds: each parameter, then its optimizer state."""
    out = []
    for p in model.parameters():
        out.append(p.detach())
        out.extend(v for v in optimizer.state[p].values() if isinstance(v, torch.Tensor))
    return out


# ---------------------------------------------------------------------------------------------
# Structured results (the contract between every bench_*.py and run.py)
# ---------------------------------------------------------------------------------------------
def metric(system: str, name: str, unit: str, values: Sequence[float], x: float | None = None,
           **extra) -> dict:
    """One measured quantity of one system: median with min-max over ``values`` (one per repeat).
    ``name`` is a stable key (``save_s``, ``stall_s``, ``peak_mib``, ``tokens_per_s`` ...); ``x`` is
    the scaling variable of a curve (state bytes, ranks) when the metric is one point of one."""
    vals = [float(v) for v in values]
    return {"system": system, "metric": name, "unit": unit, "median": median(vals) if vals else None,
            "min": min(vals) if vals else None, "max": max(vals) if vals else None, "n": len(vals),
            **({"x": x} if x is not None else {}), **extra}


def goal(name: str, measured: float | None, target: float, direction: str, detail: str = "") -> dict:
    """A goal the report states, with what the run measured: ``direction`` is ``">="`` or ``"<="``
    (``measured`` against ``target``); ``met`` is None when the run could not measure it."""
    met = None if measured is None else (measured >= target if direction == ">=" else measured <= target)
    return {"goal": name, "measured": measured, "target": target, "direction": direction, "met": met,
            "detail": detail}


def write_json(path: str | None, bench: str, section: str, command: str, *, metrics: Sequence[dict] = (),
               goals: Sequence[dict] = (), series: dict | None = None, params: dict | None = None) -> None:
    """With ``--json PATH``: the section's markdown and its numbers in one file for ``run.py``.

    ``series`` holds the data of the plots that are not a metric per system (e.g. the delta ratio per
    save over a training run: ``{"delta_ratio": {"ours": [[step, ratio], ...], ...}}``)."""
    if not path:
        return
    import json

    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    record = {"bench": bench, "date": date, "command": command, "params": params or {},
              "metrics": list(metrics), "goals": list(goals), "series": series or {}, "section": section}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, default=str) + "\n")

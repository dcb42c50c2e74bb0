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
- Machine description (from ``machine``, re-exported): ``machine_description``, ``git_state``,
  ``Load`` (the machine's other load over a stretch of the run) and their parts.
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
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from machine import (  # noqa: E402,F401  (re-exported: harness is the scripts' one import)
    Load, cpu_model, filesystem_of, git_state, machine_description, memory_description, pressure_totals,
    top_other_processes,
)

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

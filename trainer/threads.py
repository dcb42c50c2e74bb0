"""The trainer's torch intra-op thread count, chosen once per process before the model is built.

torchrun sets ``OMP_NUM_THREADS=1`` in its ranks when it starts more than one per node; a plain
``python -m trainer.train`` sets nothing, and torch then starts one thread per core it sees,
whatever else runs on them. The count (:func:`choose`):

* an explicit ``OMP_NUM_THREADS`` (a positive integer; of a comma list, the first: the outer level),
  honoured as given;
* else the cores this process may run on (``os.sched_getaffinity``: taskset, a cgroup's cpuset;
  ``os.cpu_count`` where the call is missing) divided by the ranks on this node
  (``LOCAL_WORLD_SIZE``, 1 without torchrun), at least 1.

:func:`set_torch_threads` applies it (``torch.set_num_threads``); the trainer prints it in its
header line. Only the command line sets it: a program that builds a :class:`trainer.train.Trainer`
itself keeps its own setting (benchmarks/bench_trainer.py's ``--threads``, the tests' one thread)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Threads:
    count: int
    reason: str  # where the count comes from, for the header line

    def __str__(self) -> str:
        return f"{self.count} torch thread{'s' if self.count != 1 else ''} ({self.reason})"


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform (macOS, Windows)
        return os.cpu_count() or 1


def _positive_int(text: str | None) -> int | None:
    text = (text or "").split(",")[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def choose(environ: Mapping[str, str] | None = None, cores: int | None = None) -> Threads:
    """The intra-op thread count for this process (see the module docstring)."""
    environ = os.environ if environ is None else environ
    explicit = _positive_int(environ.get("OMP_NUM_THREADS"))
    if explicit is not None:
        return Threads(explicit, "OMP_NUM_THREADS")
    cores = usable_cores() if cores is None else cores
    local = _positive_int(environ.get("LOCAL_WORLD_SIZE")) or 1
    ranks = f"{local} rank{'s' if local != 1 else ''} on this node"
    return Threads(max(1, cores // local), f"{cores} usable core{'s' if cores != 1 else ''} / {ranks}")


def set_torch_threads(environ: Mapping[str, str] | None = None) -> Threads:
    """:func:`choose`, applied to torch; returns it."""
    threads = choose(environ)
    torch.set_num_threads(threads.count)
    return threads

"""How a trainer run ends: its exit code, and exactly one line on stderr for an expected failure.

The codes (the table is also in :mod:`trainer.train`'s docstring, i.e. ``--help``, and docs/TRAINER.md):

* :data:`DONE` 0: trained to ``training.steps`` or wrote the seed checkpoint;
* :data:`FAILED` 1: the run started, then a checkpoint could not be loaded or (``checkpoint.on_error
  = stop``) saved: :class:`Failed`, or any :class:`~ckpt.errors.CheckpointError` from training;
* :data:`REFUSED` 2: refused before training, nothing written: :class:`Refused`,
  :class:`~trainer.config.ConfigError`, :class:`~trainer.parallel.ParallelismError`;
* 128 + the signal's number (143 SIGTERM, 130 SIGINT): stopped early by that signal at a step
  boundary (:mod:`trainer.signals`), the in-flight save finished, the newest committed step named.

Anything else is a bug or an accident (out of memory, a lost peer) and keeps its traceback (exit 1,
Python's). The line is this process's: under torchrun each rank that fails prints its own, except a
refusal every rank raises alike (:func:`refusing_together`: a locked checkpoint folder), which each
node's local rank 0 alone prints, before torchrun's report of the failed workers; every rank still
exits 2.

:func:`release_process_groups` ends a run's process groups for good before the interpreter's
finalization, so the exit code is the run's own (not SIGABRT from a collective's thread).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import warnings
from typing import Callable, Iterator

from ckpt.errors import CheckpointError
from ckpt.redact import redact
from ckpt.manager import CheckpointManager
from .config import ConfigError
from .parallel import ParallelismError
from .signals import Stopped

DONE, FAILED, REFUSED = 0, 1, 2


class Refused(Exception):
    """The run cannot start as asked (the checkpoint folder is locked or cannot be created, the
    step to load is not committed); raised before anything is written. ``every_rank``: every rank
    of the job raises this same refusal (:func:`refusing_together`)."""

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class Failed(Exception):
    """The run started and then failed in a way the trainer expects (a checkpoint save or load)."""


_REFUSALS = (Refused, ConfigError, ParallelismError)
_FAILURES = (Failed, CheckpointError)


@contextlib.contextmanager
def refusing(what: str, *, alike: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Start-up work: a CheckpointError or OSError in the block becomes :class:`Refused`, its
    message prefixed with ``what`` (e.g. ``checkpoint.folder='/x'``), ``every_rank`` when it is one of
    the ``alike`` errors (which every rank raises the same); refusals pass through."""
    try:
        yield
    except _REFUSALS:
        raise
    except (CheckpointError, OSError) as exc:
        raise Refused(f"{what}: {exc}", every_rank=isinstance(exc, alike)) from exc


@contextlib.contextmanager
def refusing_together(what: str, alike: tuple[type[Exception], ...]) -> Iterator[None]:
    """:func:`refusing` for collective start-up work whose ``alike`` errors every rank raises the same
    (rank 0's error, agreed: ``ckpt.CheckpointManager``'s lock), said by local rank 0 alone (:func:`run`).

    Under torchrun its agent sends SIGTERM to the other workers as soon as one has exited: a rank that
    is a moment late would die before its line (or report -15 instead of 2). So each worker holds
    SIGTERM from the start of the block: refused, it ignores SIGTERM until it exits (as it is about to,
    with 2); else the SIGTERM that came meanwhile is delivered when the block ends."""
    with _sigterm_held(), refusing(what, alike=alike):
        yield


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    """In a torchrun worker's main thread: SIGTERM held through the block (see :func:`refusing_together`)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or threading.current_thread() is not threading.main_thread():
        yield  # not a torchrun worker (nobody ends its siblings), or signals cannot be handled here
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: received.append(signum))
    try:
        yield
    except Refused:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # on its way out with exit 2: nothing to stop
        raise
    except BaseException:
        signal.signal(signal.SIGTERM, previous)
        raise
    signal.signal(signal.SIGTERM, previous)
    if received:
        signal.raise_signal(signal.SIGTERM)


def _says_it(exc: BaseException) -> bool:
    """Whether this process prints ``exc``'s line: a refusal every rank shares is said by each node's
    local rank 0 only (torchrun's workers' lines all go to the one terminal, or log, of their node)."""
    return not getattr(exc, "every_rank", False) or os.environ.get("LOCAL_RANK", "0") == "0"


def save_failed(manager: CheckpointManager, failure: CheckpointError | None) -> Failed:
    """What a run stops with when a save failed under on_error=stop: ``failure`` is this rank's
    error, or None when another rank's reached it first (this rank's own copy arrives with its
    pending write, so wait for it); names the step a restart resumes from."""
    if failure is None:
        try:
            manager.wait()
        except CheckpointError as exc:
            failure = exc
    steps = manager.steps()
    then = f"a restart resumes from step {steps[-1]}" if steps else "no step is committed"
    return Failed(f"{failure or 'a checkpoint save failed on another rank'} (checkpoint.on_error=stop; {then})")


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in redact(text).splitlines() if line.strip())  # no credential


def run(body: Callable[[], None]) -> int:
    """Call ``body``; return :data:`DONE`, or print an expected error as one ``error: ...`` line
    on stderr (a refusal every rank shares: on local rank 0 only) and return its code. Other exceptions propagate with their traceback. Meanwhile each
    warning (e.g. a failed save under on_error=continue) is printed as one ``warning: ...`` line
    (the engine's log records of the same events go only to handlers the user configured)."""
    format_warning = warnings.formatwarning
    warnings.formatwarning = lambda message, *_args, **_kwargs: f"warning: {_one_line(str(message))}\n"
    try:
        body()
    except Stopped as stop:  # preempted at a step boundary: the run already said where it stopped
        return stop.exit_code
    except _REFUSALS + _FAILURES as exc:
        if _says_it(exc):  # flushed now: before torchrun's report of the failed workers
            print(f"error: {_one_line(str(exc)) or type(exc).__name__}", file=sys.stderr, flush=True)
        return REFUSED if isinstance(exc, _REFUSALS) else FAILED
    finally:
        warnings.formatwarning = format_warning
    return DONE


def release_process_groups() -> None:
    """Free the finished run's process groups now, their worker threads joined, while the interpreter
    is whole. Call it after the run's objects are dropped (``main`` does, on its way out).

    ``destroy_process_group`` only unregisters the groups: a C++ group lives on while anything refers to
    it (the device mesh, the pipeline's stages, DTensors, all in reference cycles with the model), and
    so do its gloo worker threads. A worker that has just finished a collective releases the work's
    tensors itself, which takes the GIL; when the main thread ran on to the interpreter's finalization
    meanwhile (a loaded machine leaves the worker waiting for a core), Python ends the worker with
    ``pthread_exit`` inside that C++ destructor and the process aborts: "terminate called without an
    active exception", SIGABRT after "run finished" (issue 36 item 2). Collecting the run's garbage here
    destroys the groups; each joins its workers (torch's binding releases the GIL while it waits), so
    no worker outlives ``main``. ``os._exit`` would hide the abort and skip the flushes of a normal exit."""
    gc.collect()

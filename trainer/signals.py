"""Preemption: SIGTERM and SIGINT end a run at a step boundary, agreed on by every rank.

A scheduler (SLURM, Kubernetes, torchrun passing on its own SIGTERM) asks a job to stop with
SIGTERM, a person with Ctrl-C. While the trainer trains, :class:`StopSignals` only records the
first such signal; the training loop folds "did any rank get one?" into the all-reduce it already
makes each step, so every rank stops after the same step. Then the in-flight save finishes, a final
checkpoint of that step is written when ``checkpoint.save_on_signal`` is set, and the run ends with
:class:`Stopped` (exit 128 + the signal's number: 143 for SIGTERM, 130 for SIGINT, as a shell
reports a command a signal ended), naming the newest committed step. A second signal stops at once
(Python's default: KeyboardInterrupt / termination), for a run stuck inside a step.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The run stopped early at a step boundary because of ``signum``."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Records the first SIGTERM/SIGINT while active (a context manager; handlers restored on exit).
    Outside the main thread (a trainer driven from a worker thread) it records nothing."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # the second one: stop now
            self._restore()
            signal.raise_signal(signum)
            return
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in HANDLED:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self._restore()

    @property
    def received(self) -> bool:
        return self.signum is not None

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
